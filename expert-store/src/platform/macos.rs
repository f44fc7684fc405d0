//! macOS: `sysctl`, Mach host and task statistics, F_NOCACHE / F_RDAHEAD, `msync(MS_INVALIDATE)`.

use std::ffi::{c_void, CStr};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;

use nix::libc;

/// A fixed-size `sysctl` value (`u64`, `i32`...) by name.
fn sysctl<T: Copy + Default>(name: &CStr) -> Option<T> {
    let mut value = T::default();
    let mut len = std::mem::size_of::<T>();
    // SAFETY: `name` is NUL-terminated; `value` is a writable `T` of `len` bytes and the kernel writes at
    // most `len` bytes, reporting how many; no new value is set (null, 0).
    let rc = unsafe {
        libc::sysctlbyname(
            name.as_ptr(),
            (&mut value as *mut T).cast(),
            &mut len,
            std::ptr::null_mut(),
            0,
        )
    };
    (rc == 0 && len == std::mem::size_of::<T>()).then_some(value)
}

/// A string `sysctl` value by name.
fn sysctl_string(name: &CStr) -> Option<String> {
    let mut buf = [0u8; 256];
    let mut len = buf.len();
    // SAFETY: as in `sysctl`, into a 256-byte buffer.
    let rc = unsafe {
        libc::sysctlbyname(
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            &mut len,
            std::ptr::null_mut(),
            0,
        )
    };
    if rc != 0 {
        return None;
    }
    let s = CStr::from_bytes_until_nul(&buf[..len.min(buf.len())]).ok()?;
    Some(s.to_string_lossy().into_owned())
}

pub(super) fn huge_pages() -> Option<super::HugePages> {
    None
}

pub(super) fn os_release() -> Option<String> {
    sysctl_string(c"kern.osproductversion")
}

pub(super) fn total_memory() -> Option<u64> {
    sysctl::<u64>(c"hw.memsize")
}

pub(super) fn available_memory() -> Option<u64> {
    // SAFETY: a zeroed `vm_statistics64` is a valid value (plain integers).
    let mut stats: libc::vm_statistics64 = unsafe { std::mem::zeroed() };
    let mut count = libc::HOST_VM_INFO64_COUNT;
    // SAFETY: `stats` has room for HOST_VM_INFO64_COUNT integers, which `count` says; the kernel writes at
    // most that many and updates `count`. `mach_host_self` returns this task's send right to the host port.
    // (libc marks the Mach calls deprecated in favour of the mach2 crate; they are the same symbols.)
    #[allow(deprecated)]
    let rc = unsafe {
        libc::host_statistics64(
            libc::mach_host_self(),
            libc::HOST_VM_INFO64,
            (&mut stats as *mut libc::vm_statistics64).cast(),
            &mut count,
        )
    };
    if rc != libc::KERN_SUCCESS {
        return None;
    }
    let counts = super::VmPageCounts {
        free: u64::from(stats.free_count),
        inactive: u64::from(stats.inactive_count),
        purgeable: u64::from(stats.purgeable_count),
    };
    Some(super::available_from_vm_pages(&counts, super::page_size()))
}

pub(super) fn resident_bytes() -> Option<u64> {
    // SAFETY: a zeroed `mach_task_basic_info` is a valid value (plain integers).
    let mut info: libc::mach_task_basic_info = unsafe { std::mem::zeroed() };
    let mut count = libc::MACH_TASK_BASIC_INFO_COUNT;
    // SAFETY: `info` has room for MACH_TASK_BASIC_INFO_COUNT integers, which `count` says; the kernel writes
    // at most that many. `mach_task_self` names this task.
    #[allow(deprecated)]
    let rc = unsafe {
        libc::task_info(
            libc::mach_task_self(),
            libc::MACH_TASK_BASIC_INFO,
            (&mut info as *mut libc::mach_task_basic_info).cast(),
            &mut count,
        )
    };
    (rc == libc::KERN_SUCCESS).then_some(info.resident_size)
}

pub(super) fn huge_page_bytes(_addr: usize, _len: usize) -> Option<u64> {
    None
}

pub(super) fn gpu_working_set_limit() -> Option<u64> {
    // `sudo sysctl iogpu.wired_limit_mb=N` raises (or lowers) the limit; 0 means Metal's default.
    match sysctl::<i32>(c"iogpu.wired_limit_mb") {
        Some(mb) if mb > 0 => Some(u64::from(mb.unsigned_abs()) << 20),
        _ => total_memory().map(super::default_gpu_working_set),
    }
}

/// `fcntl(fd, cmd, arg)` for the integer-argument commands below.
fn fcntl_int(file: &File, cmd: libc::c_int, arg: libc::c_int) -> io::Result<()> {
    // SAFETY: `file` is an open descriptor for the duration of the call; F_NOCACHE and F_RDAHEAD take an
    // int and touch no memory of ours.
    if unsafe { libc::fcntl(file.as_raw_fd(), cmd, arg) } == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

pub(super) fn open_for_reads(path: &Path, uncached: bool) -> io::Result<File> {
    let file = File::open(path)?;
    if uncached {
        fcntl_int(&file, libc::F_NOCACHE, 1)?;
        // Read-ahead would fill the cache we just bypassed with bytes of the neighbouring records.
        fcntl_int(&file, libc::F_RDAHEAD, 0)?;
    }
    Ok(file)
}

pub(super) fn drop_cached_pages(file: &File) -> io::Result<()> {
    use nix::sys::mman::{mmap, msync, munmap, MapFlags, MsFlags, ProtFlags};
    let len = file.metadata()?.len();
    let Some(len) = usize::try_from(len).ok().and_then(std::num::NonZeroUsize::new) else {
        return Ok(());
    };
    // SAFETY: a shared read-only mapping of a file we hold open; it is only passed to msync and unmapped
    // below, never read through.
    let ptr = unsafe { mmap(None, len, ProtFlags::PROT_READ, MapFlags::MAP_SHARED, file, 0)? };
    // SAFETY: `ptr..ptr+len` is the mapping just made. MS_INVALIDATE makes the kernel drop the file's
    // cached pages (they are clean: we never write them).
    let synced = unsafe { msync(ptr, len.get(), MsFlags::MS_INVALIDATE) };
    // SAFETY: unmapping exactly that mapping, which nothing else uses.
    unsafe { munmap(ptr, len.get())? };
    synced?;
    Ok(())
}

pub(super) fn create_uncached(path: &Path) -> io::Result<(File, bool)> {
    let file = File::create(path)?;
    let uncached = fcntl_int(&file, libc::F_NOCACHE, 1).is_ok();
    Ok((file, uncached))
}

pub(super) fn set_cached(file: &File) -> io::Result<()> {
    fcntl_int(file, libc::F_NOCACHE, 0)
}

pub(super) fn advise_huge_pages(_ptr: NonNull<c_void>, _len: usize) {
    // Apple Silicon pages are already 16 KiB and macOS offers no transparent huge pages for user mappings.
}

pub(super) fn populate(_ptr: NonNull<c_void>, _len: usize) -> bool {
    // macOS has no advice that backs pages without writing them; they fault in on first touch, as before.
    false
}

pub(super) fn cgroup_memory() -> Option<super::CgroupMemory> {
    None
}
