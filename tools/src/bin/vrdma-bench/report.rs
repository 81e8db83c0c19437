//! What the bench prints: one line per measurement, then every target of
//! docs/performance.md against what this run measured.

use std::fmt::Write as _;
use std::time::Duration;

/// p50 and p99 of `samples` (sorted in place; zero when empty).
pub fn percentiles(samples: &mut [Duration]) -> (Duration, Duration) {
    if samples.is_empty() {
        return (Duration::ZERO, Duration::ZERO);
    }
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    (at(0.5), at(0.99))
}

/// Microseconds, two decimals.
pub fn us(d: Duration) -> String {
    format!("{:.2} µs", d.as_secs_f64() * 1e6)
}

/// Which side of its limit a figure must be on.
#[derive(Debug, Clone, Copy)]
pub enum Bound {
    AtMost(f64),
    AtLeast(f64),
    /// Within `tolerance` (a fraction) of `value`.
    Near {
        value: f64,
        tolerance: f64,
    },
}

impl Bound {
    fn holds(self, x: f64) -> bool {
        match self {
            Bound::AtMost(limit) => x <= limit,
            Bound::AtLeast(limit) => x >= limit,
            Bound::Near { value, tolerance } => (x - value).abs() <= value * tolerance,
        }
    }

    fn describe(self, unit: &str) -> String {
        match self {
            Bound::AtMost(limit) => format!("≤ {limit:.2}{unit}"),
            Bound::AtLeast(limit) => format!("≥ {limit:.2}{unit}"),
            Bound::Near { value, tolerance } => {
                format!("{value:.2}{unit} ± {:.0} %", tolerance * 100.0)
            }
        }
    }
}

/// One target and the figure this run measured for it.
struct Check {
    what: String,
    measured: f64,
    unit: &'static str,
    bound: Bound,
}

/// The targets checked so far.
#[derive(Default)]
pub struct Targets(Vec<Check>);

impl Targets {
    /// Records `measured` (in `unit`) against `bound`.
    pub fn check(
        &mut self,
        what: impl Into<String>,
        measured: f64,
        unit: &'static str,
        bound: Bound,
    ) {
        self.0.push(Check {
            what: what.into(),
            measured,
            unit,
            bound,
        });
    }

    /// Every target, measured figure and verdict, one per line.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        for c in &self.0 {
            let verdict = if c.bound.holds(c.measured) {
                "met"
            } else {
                "MISSED"
            };
            let _ = writeln!(
                out,
                "target  {:<52} {:>12} {:>18}  {verdict}",
                c.what,
                format!("{:.2}{}", c.measured, c.unit),
                c.bound.describe(c.unit),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_hold_on_their_side_only() {
        assert!(Bound::AtMost(2.0).holds(2.0));
        assert!(!Bound::AtMost(2.0).holds(2.01));
        assert!(Bound::AtLeast(4.0).holds(4.5));
        assert!(!Bound::AtLeast(4.0).holds(3.9));
        let near = Bound::Near {
            value: 3.0,
            tolerance: 0.1,
        };
        assert!(near.holds(2.71) && near.holds(3.29));
        assert!(!near.holds(2.6) && !near.holds(3.4));
    }

    #[test]
    fn percentiles_of_a_known_set() {
        let mut samples: Vec<Duration> = (1..=100).rev().map(Duration::from_micros).collect();
        let (p50, p99) = percentiles(&mut samples);
        assert_eq!(p50, Duration::from_micros(50));
        assert_eq!(p99, Duration::from_micros(99));
        assert_eq!(percentiles(&mut []), (Duration::ZERO, Duration::ZERO));
    }

    #[test]
    fn the_summary_names_a_missed_target() {
        let mut t = Targets::default();
        t.check("fast", 1.0, " µs", Bound::AtMost(2.0));
        assert!(t.0.iter().all(|c| c.bound.holds(c.measured)));
        t.check("rate", 3.0, " Mop/s", Bound::AtLeast(4.0));
        let s = t.summary();
        assert!(s.lines().next().is_some_and(|l| l.ends_with("met")), "{s}");
        assert!(
            s.lines().nth(1).is_some_and(|l| l.ends_with("MISSED")),
            "{s}"
        );
    }
}
