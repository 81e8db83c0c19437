//! A transport stub for unit tests: it records what the driver asks of the
//! transport and answers nothing on the queues (it is not a device).

use std::sync::Mutex;
use std::time::Duration;

use vrdma_spec::config::{DeviceConfig, CONFIG_MAGIC, CONFIG_SIZE};
use zerocopy::{FromZeros, IntoBytes};

use crate::dma::DmaRegion;
use crate::transport::{QueueSetup, Transport, TransportError};

#[derive(Debug, Default)]
pub(crate) struct StubTransport {
    pub(crate) features: u64,
    pub(crate) config: Vec<u8>,
    pub(crate) queues: u16,
    pub(crate) added: Mutex<Vec<(u64, u64)>>,
    pub(crate) removed: Mutex<Vec<(u64, u64)>>,
    pub(crate) setups: Mutex<Vec<QueueSetup>>,
    pub(crate) notified: Mutex<Vec<u16>>,
}

/// A valid config space with `vectors` completion vectors.
pub(crate) fn config(vectors: u16, max_queue_size: u16) -> DeviceConfig {
    let mut c = DeviceConfig::new_zeroed();
    c.magic = CONFIG_MAGIC.into();
    c.version_major = vrdma_spec::SPEC_VERSION_MAJOR.into();
    c.num_comp_vectors = vectors.into();
    c.max_queue_size = max_queue_size.into();
    c.config_size = (CONFIG_SIZE as u32).into();
    c.name[..5].copy_from_slice(b"vrdma");
    c
}

impl StubTransport {
    pub(crate) fn with_config(config: &DeviceConfig, features: u64) -> Self {
        Self {
            features,
            config: config.as_bytes().to_vec(),
            queues: vrdma_spec::num_queues(config.num_comp_vectors.get()),
            ..Default::default()
        }
    }
}

impl Transport for StubTransport {
    fn negotiate_features(&self, wanted: u64) -> Result<u64, TransportError> {
        Ok(wanted & self.features)
    }
    fn num_queues(&self) -> u16 {
        self.queues
    }
    fn read_config(&self, offset: u32, buf: &mut [u8]) -> Result<(), TransportError> {
        let start = offset as usize;
        buf.copy_from_slice(&self.config[start..start + buf.len()]);
        Ok(())
    }
    fn add_memory(&self, r: &DmaRegion<'_>) -> Result<(), TransportError> {
        assert_eq!(r.host_addr, r.device_addr, "process mode");
        self.added.lock().unwrap().push((r.device_addr, r.size));
        Ok(())
    }
    fn remove_memory(&self, r: &DmaRegion<'_>) -> Result<(), TransportError> {
        self.removed.lock().unwrap().push((r.device_addr, r.size));
        Ok(())
    }
    fn setup_queue(&self, q: &QueueSetup) -> Result<(), TransportError> {
        self.setups.lock().unwrap().push(*q);
        Ok(())
    }
    fn notify(&self, queue: u16) -> Result<(), TransportError> {
        self.notified.lock().unwrap().push(queue);
        Ok(())
    }
    fn wait(&self, _: u16, timeout: Option<Duration>) -> Result<bool, TransportError> {
        std::thread::sleep(timeout.unwrap_or(Duration::from_millis(10)));
        Ok(false)
    }
}
