//! The objects NCCL holds opaque pointers to (contexts, listen and connection objects, memory
//! registrations, requests), as ids into one table rather than raw pointers: a stale, closed or
//! foreign pointer NCCL passes back is an error with a log line, never a dereference.
//!
//! An id is 64 bits: bit 63 set (so it is never NULL nor NCCL's `0x1` marker), bits 56–62 the
//! kind, 32–55 the table index, 16–31 the entry's generation (bumped on every reuse), 0–15 free
//! for a request's place inside its connection.

use std::sync::{Arc, Mutex, RwLock};

use crate::comm::{Connecting, ListenComm, RecvComm, SendComm};
use crate::mem::MemReg;
use crate::net::NetCtx;

/// What an id names.
#[derive(Clone, Debug)]
pub enum Obj {
    /// A v11 per-communicator context.
    Ctx(Arc<NetCtx>),
    /// A listening endpoint.
    Listen(Arc<Mutex<ListenComm>>),
    /// A connection `connect` is still building.
    Connecting(Arc<Mutex<Connecting>>),
    /// A sending connection.
    Send(Arc<Mutex<SendComm>>),
    /// A receiving connection.
    Recv(Arc<Mutex<RecvComm>>),
    /// A memory registration.
    Mr(Arc<MemReg>),
}

impl Obj {
    fn kind(&self) -> u64 {
        match self {
            Obj::Ctx(_) => 1,
            Obj::Listen(_) => 2,
            Obj::Connecting(_) => 3,
            Obj::Send(_) => 4,
            Obj::Recv(_) => 5,
            Obj::Mr(_) => 6,
        }
    }
}

const MARK: u64 = 1 << 63;
const INDEX_BITS: u32 = 24;

struct Table {
    entries: Vec<(u16, Option<Obj>)>,
    free: Vec<u32>,
}

static TABLE: RwLock<Table> = RwLock::new(Table {
    entries: Vec::new(),
    free: Vec::new(),
});

/// The id's parts: kind, index, generation, sub-id.
fn split(id: u64) -> Option<(u64, usize, u16, u16)> {
    if id & MARK == 0 {
        return None;
    }
    Some((
        (id >> 56) & 0x7f,
        ((id >> 32) & ((1 << INDEX_BITS) - 1)) as usize,
        (id >> 16) as u16,
        id as u16,
    ))
}

/// Stores an object; returns its id (sub-id 0).
///
/// # Errors
/// When the table is full (16 million live objects).
pub fn insert(obj: Obj) -> Result<u64, String> {
    let mut t = TABLE.write().unwrap_or_else(|e| e.into_inner());
    let kind = obj.kind();
    let index = match t.free.pop() {
        Some(i) => i as usize,
        None => {
            if t.entries.len() >= 1 << INDEX_BITS {
                return Err("too many plugin objects alive".into());
            }
            t.entries.push((0, None));
            t.entries.len() - 1
        }
    };
    let e = &mut t.entries[index];
    e.0 = e.0.wrapping_add(1);
    e.1 = Some(obj);
    Ok(MARK | (kind << 56) | ((index as u64) << 32) | (u64::from(e.0) << 16))
}

/// The object an id names (whatever its sub-id), if it is alive.
pub fn get(id: u64) -> Option<Obj> {
    let (kind, index, generation, _) = split(id)?;
    let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
    let (g, obj) = t.entries.get(index)?;
    let obj = obj.as_ref()?;
    (*g == generation && obj.kind() == kind).then(|| obj.clone())
}

/// Removes the object an id names; returns it.
pub fn remove(id: u64) -> Option<Obj> {
    let (kind, index, generation, _) = split(id)?;
    let mut t = TABLE.write().unwrap_or_else(|e| e.into_inner());
    let (g, slot) = t.entries.get_mut(index)?;
    if *g != generation || slot.as_ref()?.kind() != kind {
        return None;
    }
    let obj = slot.take();
    t.free.push(index as u32);
    obj
}

/// The id with a sub-id (a request inside a connection).
pub fn with_sub(id: u64, sub: u16) -> u64 {
    (id & !0xffff) | u64::from(sub)
}

/// An id's sub-id.
pub fn sub(id: u64) -> u16 {
    id as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> Obj {
        Obj::Ctx(Arc::new(NetCtx { comm_id: 7 }))
    }

    #[test]
    fn ids_are_checked_by_kind_generation_and_mark() {
        let a = insert(ctx()).unwrap();
        assert!(a & MARK != 0 && a != 1);
        assert!(matches!(get(a), Some(Obj::Ctx(c)) if c.comm_id == 7));
        assert!(matches!(get(with_sub(a, 9)), Some(Obj::Ctx(_))));
        assert_eq!(sub(with_sub(a, 9)), 9);
        // Another kind with the same index and generation is not it.
        let forged = (a & !(0x7f << 56)) | (4 << 56);
        assert!(get(forged).is_none());
        assert!(get(a & !MARK).is_none());
        assert!(get(0).is_none() && get(1).is_none());
        assert!(remove(a).is_some());
        assert!(get(a).is_none());
        assert!(remove(a).is_none());
        // The slot is reused with a new generation: the old id stays dead.
        let b = insert(ctx()).unwrap();
        assert_ne!(a, b);
        assert!(get(a).is_none());
        remove(b);
    }
}
