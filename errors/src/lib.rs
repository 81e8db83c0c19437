//! vrdma-errors: how vrdma's programs report an error.
//!
//! Every layer's error says what it was doing and keeps what went wrong
//! underneath as its `source()`, without repeating it in its own message
//! (docs: the conventions on errors). The whole chain is then printed
//! once, at the top — a daemon's exit message, a refusal sent to a peer, a
//! verbs library's log line — by [`error_chain`].
//!
//! This is the one copy, for hostd, vdev and the guest driver alike; it has
//! no dependencies, so the driver (which runs inside tenants) pulls in
//! nothing of the host's.

use std::error::Error;

/// Renders an error and its sources on one line: `error: cause: cause`.
pub fn error_chain(e: &dyn Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|l| l as _)
        }
    }

    #[test]
    fn the_chain_is_printed_outermost_first() {
        let e = Layer(
            "Cannot register with hostd",
            Some(Box::new(Layer(
                "hostd channel failed",
                Some(Box::new(Layer("Connection refused", None))),
            ))),
        );
        assert_eq!(
            error_chain(&e),
            "Cannot register with hostd: hostd channel failed: Connection refused"
        );
        assert_eq!(error_chain(&Layer("Alone", None)), "Alone");
    }
}
