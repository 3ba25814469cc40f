//! Handing shared objects between ranks that are threads of one process.
//!
//! A process group moves bytes, not Rust objects. Ranks that share an address space
//! (the ThreadGroup's threads, or one NcclGroup rank per GPU as threads of one test
//! process) can still share an `Arc`: the owner puts it in a process-global table
//! under a fresh id, the id travels through the group as a number, and the other ranks
//! take their own `Arc` from the table. The table holds `Weak`s only, so it never keeps
//! anything alive by itself; entries are removed by a guard once everyone took theirs.
//!
//! Whether two ranks share the process is decided by [`process_token`], a number that
//! differs between processes (even between hosts whose process ids collide).

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

type Table = Mutex<HashMap<u64, Weak<dyn Any + Send + Sync>>>;

fn table() -> &'static Table {
    static TABLE: OnceLock<Table> = OnceLock::new();
    TABLE.get_or_init(Default::default)
}

/// A number identifying this process among the processes of a job: its id mixed with
/// the time it first asked and an address of this process (ASLR), so that processes
/// on different hosts with equal ids still differ. Never 0.
pub(super) fn process_token() -> u64 {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(|| {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let addr = &TOKEN as *const _ as u64;
        let mut x = u64::from(std::process::id()) ^ nanos.rotate_left(17) ^ addr.rotate_left(41);
        // splitmix64 finaliser: spread the bits.
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^= x >> 31;
        x.max(1)
    })
}

/// A number identifying this machine (its kernel's boot id, else its host name), 0 when
/// neither can be read. Ranks with different nonzero host tokens are on different hosts.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) fn host_token() -> u64 {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(|| {
        ["/proc/sys/kernel/random/boot_id", "/etc/hostname"]
            .iter()
            .filter_map(|p| std::fs::read_to_string(p).ok())
            .map(|s| s.trim().to_owned())
            .find(|s| !s.is_empty())
            .map_or(0, |s| {
                // FNV-1a, never 0 for a readable id.
                let h = s.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| {
                    (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
                });
                h.max(1)
            })
    })
}

/// Publishes `value` until the guard drops; returns the guard and the id to send.
pub(super) fn publish<T: Any + Send + Sync>(value: &Arc<T>) -> Published {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    let weak: Weak<dyn Any + Send + Sync> = Arc::downgrade(value) as Weak<dyn Any + Send + Sync>;
    let mut t = table().lock().unwrap_or_else(|e| e.into_inner());
    // Entries whose guard was leaked with their object gone: prune them.
    t.retain(|_, w| w.strong_count() > 0);
    t.insert(id, weak);
    Published { id }
}

/// The object published under `id`, if it is still alive and of type `T`.
pub(super) fn lookup<T: Any + Send + Sync>(id: u64) -> Option<Arc<T>> {
    let t = table().lock().unwrap_or_else(|e| e.into_inner());
    t.get(&id)?.upgrade()?.downcast::<T>().ok()
}

/// Keeps an object published; removes the entry when dropped.
#[derive(Debug)]
pub(super) struct Published {
    id: u64,
}

impl Published {
    /// The id the other ranks look the object up with.
    pub(super) fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for Published {
    fn drop(&mut self) {
        table()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_lookup_and_removal() {
        let v = Arc::new(42u32);
        let p = publish(&v);
        assert_eq!(lookup::<u32>(p.id()).as_deref(), Some(&42));
        assert!(lookup::<u64>(p.id()).is_none(), "wrong type");
        let id = p.id();
        drop(p);
        assert!(lookup::<u32>(id).is_none(), "removed with its guard");
        let w = Arc::new(7u8);
        let p = publish(&w);
        drop(w);
        assert!(lookup::<u8>(p.id()).is_none(), "never keeps objects alive");
        assert_ne!(process_token(), 0);
        assert_eq!(process_token(), process_token());
        assert_eq!(host_token(), host_token());
    }
}
