//! The RoCEv2 wire format (placeholder).
