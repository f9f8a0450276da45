//! [`HostBuffer`]: memory a region can own (heap, anonymous or huge-page mappings).

#![allow(unsafe_code)] // raw views of owned memory

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// Memory a region can own: it lives exactly as long as the region and never moves.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    kind: BufferKind,
}

enum BufferKind {
    /// A boxed slice given up with `Box::into_raw` and rebuilt on drop. Keeping the `Box` itself
    /// would assert unique access to the bytes on every move of the buffer and invalidate `ptr`
    /// (undefined behaviour that Miri reports).
    Heap,
    Map(#[allow(dead_code)] memmap2::MmapMut),
}

// SAFETY: a Buffer owns its memory exclusively (a boxed slice or a private mapping); the raw
// pointer is only a cached view of that owned memory, so moving it between threads is as safe as
// moving the Box or the MmapMut.
unsafe impl Send for HostBuffer {}
// SAFETY: shared references to a Buffer only give out shared references to its bytes.
unsafe impl Sync for HostBuffer {}

/// The size of an x86-64 or AArch64 (4 KiB granule) huge page.
const HUGE_PAGE: usize = 2 << 20;

impl HostBuffer {
    /// `len` zeroed bytes in a private anonymous mapping (page aligned: what RDMA prefers),
    /// resident from the start.
    ///
    /// Every page is faulted in when the mapping is made (`MAP_POPULATE`), the state a
    /// registration on a hardware device leaves memory in (it pins every page). Untouched, the
    /// first write of each page would fault in the middle of a transfer: on the soft device,
    /// inside the device's packet placement. The memory is committed at once, so allocate what
    /// is used.
    ///
    /// # Errors
    /// [`Error::Io`] when the mapping fails; [`Error::InvalidArgument`] for `len == 0`.
    pub fn zeroed(len: usize) -> Result<HostBuffer> {
        if len == 0 {
            return Err(Error::invalid("a buffer needs at least one byte"));
        }
        // From 2 MiB, ask for transparent huge pages (where the system gives them on request,
        // `madvise` mode): a peer's one-copy read of the buffer (payloads by reference) pins
        // its pages, and the kernel's walk per 4 KiB page was a fifth of that copy's cost.
        // Advice must come before the pages exist, so such a buffer is populated after it.
        let huge = len >= HUGE_PAGE && !cfg!(miri);
        let mut options = memmap2::MmapOptions::new();
        options.len(len);
        // Miri models only plain private anonymous mappings; populating changes no semantics.
        if !cfg!(miri) && !huge {
            options.populate();
        }
        let mut map = options
            .map_anon()
            .map_err(|e| Error::io(format!("mapping {len} anonymous bytes"), e))?;
        if huge {
            // A hint: without huge pages the buffer is made of small ones.
            let _ = map.advise(memmap2::Advice::HugePage);
            // Before Linux 5.14 (no MADV_POPULATE_WRITE), a write to each page faults it in.
            if map.advise(memmap2::Advice::PopulateWrite).is_err() {
                for i in (0..len).step_by(4096) {
                    map[i] = 0;
                }
            }
        }
        Ok(HostBuffer::from_map(map))
    }

    /// `len` zeroed bytes backed by huge pages (`MAP_HUGETLB`), rounded up to 2 MiB. Huge pages
    /// lift eRDMA's limit on registrable memory and cut translation cost.
    ///
    /// # Errors
    /// [`Error::Io`] when no huge pages are available (see `/proc/sys/vm/nr_hugepages`).
    pub fn huge(len: usize) -> Result<HostBuffer> {
        if len == 0 {
            return Err(Error::invalid("a buffer needs at least one byte"));
        }
        let len = len.div_ceil(HUGE_PAGE) * HUGE_PAGE;
        let map = memmap2::MmapOptions::new()
            .len(len)
            .huge(Some(21))
            .map_anon()
            .map_err(|e| Error::io(format!("mapping {len} bytes of huge pages"), e))?;
        Ok(HostBuffer::from_map(map))
    }

    fn from_map(mut map: memmap2::MmapMut) -> HostBuffer {
        let len = map.len();
        let ptr = NonNull::new(map.as_mut_ptr()).unwrap_or(NonNull::dangling());
        HostBuffer {
            ptr,
            len,
            kind: BufferKind::Map(map),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never, for buffers made by this module).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether huge pages back this buffer.
    pub fn kind_name(&self) -> &'static str {
        match self.kind {
            BufferKind::Heap => "heap",
            BufferKind::Map(_) => "mapping",
        }
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl From<Vec<u8>> for HostBuffer {
    fn from(v: Vec<u8>) -> HostBuffer {
        HostBuffer::from(v.into_boxed_slice())
    }
}

impl From<Box<[u8]>> for HostBuffer {
    fn from(b: Box<[u8]>) -> HostBuffer {
        let len = b.len();
        // `Box::into_raw` never returns null (an empty slice gets a dangling, aligned pointer,
        // which `Drop` hands back to `Box::from_raw` unchanged).
        let ptr = NonNull::new(Box::into_raw(b).cast::<u8>()).expect("Box::into_raw is non-null");
        HostBuffer {
            ptr,
            len,
            kind: BufferKind::Heap,
        }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let BufferKind::Heap = self.kind {
            let raw = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
            // `ptr` and `len` are exactly what `Box::into_raw` gave for a `Box<[u8]>` in
            // `From<Box<[u8]>>`, nothing else frees it, and this runs once.
            // SAFETY: rebuilds the box `Box::into_raw` gave up, once (above).
            drop(unsafe { Box::from_raw(raw) });
        }
    }
}

impl Deref for HostBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // `ptr` points at `len` initialised bytes owned by `kind` for as long as `self` lives,
        // and `&self` rules out a concurrent `&mut`.
        // SAFETY: the bytes are initialised, owned and not mutably borrowed (above).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for HostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("addr", &self.ptr)
            .field("len", &self.len)
            .field("kind", &self.kind_name())
            .finish()
    }
}
