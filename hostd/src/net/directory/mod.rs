//! The directory of which host serves which GID (placeholder).
