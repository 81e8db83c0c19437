//! hostd on the network: the packet queues it sends and receives RoCEv2
//! packets through ([`io`]) and the directory of which host serves which
//! GID ([`directory`]). The RC transport that runs over them is in
//! `engine/wire/`.

pub mod directory;
pub mod io;
