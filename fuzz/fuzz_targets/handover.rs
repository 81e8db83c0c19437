#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vrdma_fuzz_checks::handover::check(data));
