//! Linux: `/proc`, O_DIRECT, `posix_fadvise`, transparent huge pages.

use std::ffi::c_void;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::ptr::NonNull;

use nix::fcntl::{fcntl, FcntlArg, OFlag};

fn meminfo(key: &str) -> Option<u64> {
    super::meminfo_bytes(&std::fs::read_to_string("/proc/meminfo").ok()?, key)
}

pub(super) fn huge_pages() -> Option<super::HugePages> {
    super::parse_huge_pages(&std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?)
}

pub(super) fn os_release() -> Option<String> {
    Some(
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .ok()?
            .trim()
            .to_string(),
    )
}

pub(super) fn total_memory() -> Option<u64> {
    meminfo("MemTotal")
}

pub(super) fn available_memory() -> Option<u64> {
    meminfo("MemAvailable")
}

/// The tightest memory cgroup limit on this process (a container's `--memory`, a systemd `MemoryMax`), and
/// what is charged against it: `/proc/meminfo` shows the whole host's memory there.
pub(super) fn cgroup_memory() -> Option<super::CgroupMemory> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    super::memory_cgroup_dirs(&cgroup, &mountinfo)
        .iter()
        .filter_map(cgroup_dir_memory)
        .min_by_key(|cg| cg.available())
}

pub(super) fn cgroup_dir_memory(cg: &super::CgroupDir) -> Option<super::CgroupMemory> {
    use super::{cgroup_limit, cgroup_stat, CgroupMemory, CgroupVersion};
    let read = |dir: &Path, name: &str| std::fs::read_to_string(dir.join(name)).ok();
    // v2's `memory.high` binds too: past it the kernel throttles the cgroup and reclaims hard (a systemd
    // `MemoryHigh`, Kubernetes' memory QoS), which a streaming server must stay under as under `memory.max`.
    let (limit_files, usage_file, file_keys): (&[&str], _, _) = match cg.version {
        CgroupVersion::V1 => (
            &["memory.limit_in_bytes"],
            "memory.usage_in_bytes",
            ["total_inactive_file", "total_active_file"],
        ),
        CgroupVersion::V2 => (
            &["memory.max", "memory.high"],
            "memory.current",
            ["inactive_file", "active_file"],
        ),
    };
    // What a directory holds against its limit: its whole subtree's charge (siblings included, for a parent)
    // less its file pages, active and inactive, which reclaim gives back, as MemAvailable counts the page
    // cache.
    let used = |dir: &Path, stat: &str| {
        let charged = read(dir, usage_file)
            .and_then(|t| t.trim().parse::<u64>().ok())
            .unwrap_or(0);
        let files: u64 = file_keys.iter().filter_map(|k| cgroup_stat(stat, k)).sum();
        charged.saturating_sub(files)
    };
    // Every limit from the process's cgroup up to the mount binds it, each against its own directory's usage;
    // the tightest room wins. v1 also states the hierarchy's limit in `hierarchical_memory_limit` (ancestors
    // the mount may hide), taken against the process's own usage.
    let own_stat = read(&cg.dir, "memory.stat").unwrap_or_default();
    let hierarchical = cgroup_stat(&own_stat, "hierarchical_memory_limit")
        .and_then(super::limit_set)
        .map(|limit| CgroupMemory {
            limit,
            used: used(&cg.dir, &own_stat),
        });
    let walked = (cg.dir.ancestors())
        .take_while(|d| d.starts_with(&cg.mount))
        .filter_map(|d| {
            let limit = (limit_files.iter())
                .filter_map(|f| read(d, f).as_deref().and_then(cgroup_limit))
                .min()?;
            let stat = read(d, "memory.stat").unwrap_or_default();
            Some(CgroupMemory {
                limit,
                used: used(d, &stat),
            })
        });
    let all: Vec<CgroupMemory> = walked.chain(hierarchical).collect();
    let limit = all.iter().map(|c| c.limit).min()?;
    let available = all.iter().map(|c| c.available()).min()?;
    Some(CgroupMemory {
        limit,
        used: limit.saturating_sub(available),
    })
}

pub(super) fn resident_bytes() -> Option<u64> {
    super::statm_resident_bytes(&std::fs::read_to_string("/proc/self/statm").ok()?, super::page_size())
}

pub(super) fn huge_page_bytes(addr: usize, len: usize) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    super::smaps_huge_page_bytes(&smaps, addr, addr.checked_add(len)?)
}

pub(super) fn gpu_working_set_limit() -> Option<u64> {
    None
}

pub(super) fn open_for_reads(path: &Path, uncached: bool) -> io::Result<File> {
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    if uncached {
        opts.custom_flags(nix::libc::O_DIRECT);
    }
    opts.open(path)
}

pub(super) fn drop_cached_pages(file: &File) -> io::Result<()> {
    nix::fcntl::posix_fadvise(
        file.as_raw_fd(),
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    )?;
    Ok(())
}

pub(super) fn create_uncached(path: &Path) -> io::Result<(File, bool)> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true)
        .create(true)
        .truncate(true)
        .custom_flags(nix::libc::O_DIRECT);
    match o.open(path) {
        Ok(f) => Ok((f, true)),
        // Filesystems without O_DIRECT (tmpfs) refuse it at open.
        Err(_) => Ok((File::create(path)?, false)),
    }
}

pub(super) fn set_cached(file: &File) -> io::Result<()> {
    let fd = file.as_raw_fd();
    let flags = OFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GETFL)?);
    fcntl(fd, FcntlArg::F_SETFL(flags - OFlag::O_DIRECT))?;
    Ok(())
}

pub(super) fn advise_huge_pages(ptr: NonNull<c_void>, len: usize) {
    // SAFETY: the caller passes a mapping it just made and has not touched; MADV_HUGEPAGE only changes how
    // the kernel backs it. Failure (THP disabled) is harmless.
    let _ = unsafe { nix::sys::mman::madvise(ptr, len, nix::sys::mman::MmapAdvise::MADV_HUGEPAGE) };
}

pub(super) fn populate(ptr: NonNull<c_void>, len: usize) -> bool {
    // SAFETY: MADV_POPULATE_WRITE (Linux 5.14+) only faults pages in, zero-filled where absent, and never
    // changes a present page's bytes, so it is sound over memory other threads are writing. Older kernels
    // refuse it with EINVAL.
    unsafe { nix::libc::madvise(ptr.as_ptr(), len, nix::libc::MADV_POPULATE_WRITE) == 0 }
}
