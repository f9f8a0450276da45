use super::*;

#[test]
fn access_rules() {
    check_access(Access::LOCAL_WRITE).unwrap();
    check_access(Access::ALL).unwrap();
    check_access(Access::REMOTE_READ).unwrap();
    assert!(check_access(Access::REMOTE_WRITE).is_err());
    assert!(check_access(Access::REMOTE_ATOMIC).is_err());
    assert_eq!(Access::REMOTE_READ.bits(), 4);
    assert!(Access::ALL.is_remote() && !Access::LOCAL_WRITE.is_remote());
}

/// A peer's description can name any address: a part that would run past the top of the
/// address space is out of bounds, not an overflow.
#[test]
fn remote_parts_near_the_top_of_the_address_space() {
    let peer = RemoteMr {
        addr: u64::MAX - 15,
        len: 64,
        rkey: 7,
    };
    assert!(matches!(peer.slice(8, 8), Ok(r) if r.addr == u64::MAX - 7 && r.len == 8));
    assert!(matches!(
        peer.slice(8, 16),
        Err(Error::OutOfBounds {
            offset: 8,
            len: 16,
            ..
        })
    ));
    assert!(peer.slice(32, 1).is_err());
    assert!(peer.at(20).is_err());
    let whole = RemoteMr {
        addr: 4096,
        len: u64::MAX,
        rkey: 7,
    };
    assert!(whole.slice(u64::MAX - 10, 10).is_err());
    assert!(whole.slice(0, 10).is_ok());
}

#[test]
fn buffers_are_zeroed_and_stable() {
    let mut b = HostBuffer::zeroed(10_000).unwrap();
    assert_eq!(b.len(), 10_000);
    assert!(b.iter().all(|&x| x == 0));
    let p = b.as_ptr();
    b[9_999] = 7;
    let moved = b;
    assert_eq!(moved.as_ptr(), p);
    assert_eq!(moved[9_999], 7);
    assert!(HostBuffer::zeroed(0).is_err());
    let v = HostBuffer::from(vec![1u8, 2, 3]);
    assert_eq!(&v[..], &[1, 2, 3]);
}

/// A buffer's pages are resident before anything touches them: no page fault waits for the
/// first transfer into it.
#[test]
#[cfg_attr(miri, ignore)] // mincore is a system call
fn zeroed_buffers_are_resident() {
    // SAFETY: sysconf only reads a system setting.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let len = 64 * page + 100;
    let b = HostBuffer::zeroed(len).unwrap();
    let pages = len.div_ceil(page);
    let mut vec = vec![0u8; pages];
    // `vec` has one byte per page of the buffer's own page-aligned mapping.
    // SAFETY: mincore reads the mapping's page table and writes `pages` bytes into `vec`.
    let rc = unsafe { libc::mincore(b.as_ptr() as *mut libc::c_void, len, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    let missing = vec.iter().filter(|v| *v & 1 == 0).count();
    assert_eq!(
        missing, 0,
        "{missing} of {pages} pages not resident after allocation"
    );
}

/// From 2 MiB a buffer asks for transparent huge pages (a peer's one-copy read of it then pins
/// a few large pages, not thousands of small ones). It is resident and zeroed as any other;
/// where the system grants huge pages on request, some back it, and where it never does, none.
#[test]
#[cfg_attr(miri, ignore)] // mincore is a system call; /proc is not modelled
fn large_buffers_are_resident_and_use_huge_pages_where_the_system_allows() {
    let len = 8 << 20;
    let b = HostBuffer::zeroed(len).unwrap();
    let pages = len / 4096;
    let mut vec = vec![0u8; pages];
    // SAFETY: mincore reads the mapping's page table and writes `pages` bytes into `vec`.
    let rc = unsafe { libc::mincore(b.as_ptr() as *mut libc::c_void, len, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    assert!(vec.iter().all(|v| v & 1 == 1), "pages not resident");
    let mode =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    let huge_kb = anon_huge_kb(b.as_ptr() as usize);
    if mode.contains("[always]") || mode.contains("[madvise]") {
        assert!(
            huge_kb >= 2048,
            "no huge page backs an 8 MiB buffer (THP: {mode})"
        );
    } else {
        assert_eq!(
            huge_kb, 0,
            "huge pages where the system gives none (THP: {mode:?})"
        );
    }
    assert!(b.iter().all(|&x| x == 0));
}

/// `AnonHugePages` of the mapping of this process that holds `addr`, in KiB.
fn anon_huge_kb(addr: usize) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    for line in smaps.lines() {
        let range = line
            .split_whitespace()
            .next()
            .and_then(|r| r.split_once('-'));
        if let Some((lo, hi)) = range
            && let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        {
            inside = (lo..hi).contains(&addr);
        } else if inside && let Some(kb) = line.strip_prefix("AnonHugePages:") {
            return kb.trim().trim_end_matches("kB").trim().parse().unwrap();
        }
    }
    panic!("no mapping holds {addr:#x}");
}

/// Moving a heap buffer must not invalidate its cached pointer (run under Miri by
/// `scripts/leakcheck miri`: keeping the `Box` inside the buffer was undefined behaviour).
#[test]
fn heap_buffers_survive_moves() {
    let mut b = HostBuffer::from(vec![5u8; 64]);
    b[0] = 1;
    let mut moved = vec![b];
    let b = moved.pop().unwrap();
    let p = b.as_ptr();
    let boxed = Box::new(b);
    assert_eq!(boxed.as_ptr(), p);
    assert_eq!(boxed[0], 1);
    assert!(boxed[1..].iter().all(|&x| x == 5));
    let empty = HostBuffer::from(Vec::new());
    assert!(empty.is_empty() && empty.iter().next().is_none());
    assert_eq!(boxed.kind_name(), "heap");
}

#[test]
fn remote_slices_are_bounded() {
    let r = RemoteMr {
        addr: 0x1000,
        len: 100,
        rkey: 9,
    };
    assert_eq!(
        r.slice(10, 20).unwrap(),
        RemoteMr {
            addr: 0x100a,
            len: 20,
            rkey: 9
        }
    );
    assert!(r.slice(90, 11).is_err());
    assert!(r.slice(u64::MAX, 2).is_err());
    assert_eq!(r.at(99).unwrap().addr, 0x1000 + 99);
    assert!(r.at(100).is_err());
}

#[test]
fn ranges_resolve_like_slices() {
    assert_eq!(resolve(.., 10).unwrap(), (0, 10));
    assert_eq!(resolve(2..5, 10).unwrap(), (2, 5));
    assert_eq!(resolve(2..=5, 10).unwrap(), (2, 6));
    assert!(resolve(5..11, 10).is_err());
    let (hi, lo) = (6, 5);
    assert!(resolve(hi..lo, 10).is_err());
}
