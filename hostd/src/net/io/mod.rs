//! Packet I/O: the physical queues hostd sends RoCEv2 packets through (placeholder).
