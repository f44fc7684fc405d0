//! Every OS-specific call sluice makes, for Linux and macOS side by side: memory facts (total, available,
//! resident, the GPU's working-set limit), uncached file I/O, dropping a file's cached pages, the slot
//! arena's anonymous mapping and its backing ahead of use, and a thread's CPU time. The rest of the code
//! asks these questions and never reads `/proc`, calls `sysctl` or sets file flags itself.
//!
//! The arithmetic that turns the OS's raw numbers into answers is plain functions at the top of this file,
//! so it is tested on every platform (a captured macOS `vm_statistics64` is checked on Linux too).

#[cfg(target_os = "linux")]
mod linux;
#[cfg(target_os = "macos")]
mod macos;
#[cfg(not(any(target_os = "linux", target_os = "macos")))]
mod other;

#[cfg(target_os = "linux")]
use linux as os;
#[cfg(target_os = "macos")]
use macos as os;
#[cfg(not(any(target_os = "linux", target_os = "macos")))]
use other as os;

use std::fs::File;
use std::io;
use std::path::Path;
use std::ptr::NonNull;

/// The page counts of macOS's `host_statistics64(HOST_VM_INFO64)` that matter for "available memory".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VmPageCounts {
    /// `free_count`: free pages, the speculative ones included (XNU adds them in; `vm_stat` subtracts them
    /// again to print "Pages free").
    pub free: u64,
    /// Inactive pages: clean or reclaimable without swapping first.
    pub inactive: u64,
    /// Purgeable pages: volatile memory the OS may discard at once.
    pub purgeable: u64,
}

/// Bytes macOS can hand out without paging anything out: free (speculative read-ahead included), inactive and
/// purgeable pages.
///
/// This is what Activity Monitor's "memory pressure" treats as reclaimable; wired, active and compressed
/// pages are not counted. Purgeable pages also sit on the active or inactive queue, so the inactive ones are
/// counted twice: an overcount the plan's margin covers, where leaving them out would miss the active ones.
pub fn available_from_vm_pages(c: &VmPageCounts, page_size: u64) -> u64 {
    c.free
        .saturating_add(c.inactive)
        .saturating_add(c.purgeable)
        .saturating_mul(page_size)
}

/// Metal's default working-set limit (`recommendedMaxWorkingSetSize`) on an Apple Silicon Mac with `total`
/// bytes of RAM: three quarters of memory above 36 GiB, two thirds at or below. `iogpu.wired_limit_mb`
/// overrides it (see [`gpu_working_set_limit`]).
pub fn default_gpu_working_set(total: u64) -> u64 {
    if total > 36 << 30 {
        total / 4 * 3
    } else {
        total / 3 * 2
    }
}

/// A `key:  N kB` line of Linux's `/proc/meminfo`, in bytes.
pub fn meminfo_bytes(meminfo: &str, key: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.split(':').next() == Some(key))?;
    let mut words = line.split(':').nth(1)?.split_whitespace();
    let n: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => n.checked_mul(1024),
        None => Some(n),
        Some(_) => None,
    }
}

/// Bytes on transparent huge pages (`AnonHugePages`) of the mappings in Linux's `/proc/<pid>/smaps` that
/// overlap `start..end`, at most its length; `None` if no mapping overlaps it.
pub fn smaps_huge_page_bytes(smaps: &str, start: usize, end: usize) -> Option<u64> {
    let (mut found, mut inside, mut total) = (false, false, 0u64);
    for line in smaps.lines() {
        if let Some((lo, hi)) = smaps_mapping_range(line) {
            inside = lo < end && start < hi;
            found |= inside;
        } else if inside && line.starts_with("AnonHugePages:") {
            total = total.saturating_add(meminfo_bytes(line, "AnonHugePages")?);
        }
    }
    found.then(|| total.min(end.saturating_sub(start) as u64))
}

/// The address range of a mapping's header line in `smaps` (`7f12a000-7f12c000 rw-p …`); `None` for a field line.
fn smaps_mapping_range(line: &str) -> Option<(usize, usize)> {
    let (lo, hi) = line.split_whitespace().next()?.split_once('-')?;
    Some((usize::from_str_radix(lo, 16).ok()?, usize::from_str_radix(hi, 16).ok()?))
}

/// Bytes of `len` at `addr` in this process that sit on transparent huge pages; `None` where the OS does not
/// say (not Linux, or `addr` not mapped).
pub fn huge_page_bytes(addr: usize, len: usize) -> Option<u64> {
    os::huge_page_bytes(addr, len)
}

/// Resident bytes from Linux's `/proc/self/statm` (its second field counts pages).
pub fn statm_resident_bytes(statm: &str, page_size: u64) -> Option<u64> {
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    pages.checked_mul(page_size)
}

/// Which Linux cgroup hierarchy a memory cgroup belongs to (their files differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// The v1 `memory` controller (`memory.limit_in_bytes`, `memory.usage_in_bytes`).
    V1,
    /// The unified hierarchy (`memory.max`, `memory.current`).
    V2,
}

/// Where this process's memory cgroup lives: its directory and the mount point of its hierarchy (a limit set
/// on any directory between the two applies).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupDir {
    /// v1 or v2.
    pub version: CgroupVersion,
    /// The process's own cgroup directory.
    pub dir: std::path::PathBuf,
    /// The hierarchy's mount point, the last directory whose limit counts.
    pub mount: std::path::PathBuf,
}

/// This process's memory cgroups from Linux's `/proc/self/cgroup` and `/proc/self/mountinfo`: the v1 memory
/// controller's and the v2 hierarchy's, where each is mounted (a hybrid system has both; only one holds the
/// memory files). A container sees its own cgroup as the root of the mount, and its path as `/`.
pub fn memory_cgroup_dirs(cgroup: &str, mountinfo: &str) -> Vec<CgroupDir> {
    // mountinfo: `id parent major:minor root mount-point options [optional...] - fstype source super-options`
    let mounts: Vec<(&str, &str, String, String)> = mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let left: Vec<&str> = left.split(' ').collect();
            let mut right = right.split(' ');
            let fstype = right.next()?;
            let super_options = right.nth(1).unwrap_or("");
            Some((
                fstype,
                super_options,
                unescape_mount_path(left.get(3)?),
                unescape_mount_path(left.get(4)?),
            ))
        })
        .collect();
    let mut dirs = Vec::new();
    for line in cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let version = if controllers.split(',').any(|c| c == "memory") {
            CgroupVersion::V1
        } else if id == "0" && controllers.is_empty() {
            CgroupVersion::V2
        } else {
            continue;
        };
        // The mount shows the hierarchy from its `root` down: the process's path below it is what is under the
        // mount point. Of several mounts of the hierarchy, the one whose root holds the path most closely; a
        // path outside every mounted part (a cgroup namespace moved under us) leaves the first mount.
        let below = |root: &str| match root {
            "/" => Some(path),
            _ => path
                .strip_prefix(root)
                .filter(|rest| rest.is_empty() || rest.starts_with('/')),
        };
        let of_hierarchy: Vec<_> = (mounts.iter())
            .filter(|(fstype, super_options, _, _)| match version {
                CgroupVersion::V1 => *fstype == "cgroup" && super_options.split(',').any(|o| o == "memory"),
                CgroupVersion::V2 => *fstype == "cgroup2",
            })
            .collect();
        let holding = (of_hierarchy.iter())
            .filter(|(_, _, root, _)| below(root).is_some())
            .max_by_key(|(_, _, root, _)| root.len());
        let Some((_, _, root, mount)) = holding.or(of_hierarchy.first()) else {
            continue;
        };
        let below = below(root);
        let mount = std::path::PathBuf::from(mount);
        let dir = match below.map(|b| b.trim_start_matches('/')) {
            Some(rel) if !rel.is_empty() && !rel.split('/').any(|c| c == "..") => mount.join(rel),
            _ => mount.clone(),
        };
        dirs.push(CgroupDir { version, dir, mount });
    }
    dirs
}

/// A mountinfo path with its octal escapes (`\040` for a space) undone.
fn unescape_mount_path(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push(d.iter().fold(0u8, |v, c| v.wrapping_mul(8).wrapping_add(c - b'0')));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A cgroup memory limit file's value (`memory.max`, `memory.limit_in_bytes`); `None` when it sets no limit
/// (`max`, or v1's page-rounded `i64::MAX`).
pub fn cgroup_limit(text: &str) -> Option<u64> {
    limit_set(text.trim().parse().ok()?)
}

/// A cgroup limit's bytes, `None` for v1's "no limit" (`i64::MAX` rounded to pages).
fn limit_set(bytes: u64) -> Option<u64> {
    (bytes < 1 << 60).then_some(bytes)
}

/// A `key value` line of a cgroup's `memory.stat`.
pub fn cgroup_stat(stat: &str, key: &str) -> Option<u64> {
    stat.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// What a memory cgroup allows: its limit, and what is charged against it that reclaim would not give back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CgroupMemory {
    /// The least limit of the cgroup and its ancestors.
    pub limit: u64,
    /// `limit` less the least room any of those limits leaves (a limit's room: it less its own directory's
    /// charge, file pages not counted).
    pub used: u64,
}

impl CgroupMemory {
    /// What the cgroup can still give this process, reclaiming nothing but file pages.
    pub fn available(&self) -> u64 {
        self.limit.saturating_sub(self.used)
    }
}

/// The operating system's name as users know it (`macOS`, `Linux`, ...).
pub fn os_name() -> &'static str {
    match std::env::consts::OS {
        "macos" => "macOS",
        "linux" => "Linux",
        other => other,
    }
}

/// The OS release (kernel version on Linux, product version on macOS), if known.
pub fn os_release() -> Option<String> {
    os::os_release()
}

/// Linux's transparent huge page setting (`/sys/kernel/mm/transparent_hugepage/enabled`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HugePages {
    /// Every large anonymous mapping may get huge pages.
    Always,
    /// Mappings that ask for them get them (the slots and resident matrices ask).
    Madvise,
    /// Never: every mapping is on 4 KiB pages.
    Never,
}

impl std::fmt::Display for HugePages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HugePages::Always => "always",
            HugePages::Madvise => "madvise",
            HugePages::Never => "never",
        })
    }
}

/// The selected (bracketed) word of the transparent huge page setting, e.g. `always [madvise] never`.
pub fn parse_huge_pages(setting: &str) -> Option<HugePages> {
    let word = setting
        .split_whitespace()
        .find(|w| w.starts_with('[') && w.ends_with(']'))?;
    match word.trim_matches(|c| c == '[' || c == ']') {
        "always" => Some(HugePages::Always),
        "madvise" => Some(HugePages::Madvise),
        "never" => Some(HugePages::Never),
        _ => None,
    }
}

/// The transparent huge page setting; `None` where the OS has none (macOS: its 16 KiB pages are the
/// only size for user mappings) or it cannot be read.
pub fn huge_pages() -> Option<HugePages> {
    os::huge_pages()
}

/// The machine's memory as this process may use it, from one look at each source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryNow {
    /// Physical memory, or the memory cgroup's limit where that is less.
    pub total: u64,
    /// What the OS can give this process now without paging out (Linux `MemAvailable`; macOS free,
    /// inactive and purgeable pages), within the cgroup's room.
    pub available: u64,
    /// The tightest memory cgroup limit on this process and what is charged against it (Linux: a
    /// container's `--memory`, a systemd `MemoryMax` or `MemoryHigh`), which bounds both; `None` where none
    /// applies.
    pub cgroup: Option<CgroupMemory>,
}

/// Physical and available memory, each capped by the memory cgroup (read once for both).
pub fn memory_now() -> Option<MemoryNow> {
    let (total, available) = (os::total_memory()?, os::available_memory()?);
    let cgroup = os::cgroup_memory();
    Some(MemoryNow {
        total: cgroup.map_or(total, |cg| total.min(cg.limit)),
        available: cgroup.map_or(available, |cg| available.min(cg.available())).min(total),
        cgroup,
    })
}

/// This process's resident set size now.
pub fn resident_bytes() -> Option<u64> {
    os::resident_bytes()
}

/// The largest resident set size this process has had.
pub fn peak_resident_bytes() -> Option<u64> {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF).ok()?;
    let max = u64::try_from(usage.max_rss()).ok()?;
    // `ru_maxrss` is in bytes on macOS and in KiB on Linux.
    Some(if cfg!(target_os = "macos") { max } else { max * 1024 })
}

/// How much memory the GPU may keep wired (macOS: `iogpu.wired_limit_mb` when set, else Metal's default
/// for this machine's RAM); `None` where the GPU has no such limit (Linux: no unified-memory GPU here).
pub fn gpu_working_set_limit() -> Option<u64> {
    os::gpu_working_set_limit()
}

/// The virtual-memory page size.
pub fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .and_then(|n| u64::try_from(n).ok())
        .unwrap_or(4096)
}

/// Opens `path` for positional reads; `uncached` bypasses the page cache (O_DIRECT on Linux, which then
/// needs aligned offsets, lengths and buffers; F_NOCACHE with read-ahead off on macOS).
pub fn open_for_reads(path: &Path, uncached: bool) -> io::Result<File> {
    os::open_for_reads(path, uncached)
}

/// Reads up to `buf.len()` bytes of `file` at `offset` without moving its cursor (`pread`).
pub fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let offset = i64::try_from(offset).map_err(|_| io::Error::other("offset beyond i64"))?;
    Ok(nix::sys::uio::pread(file, buf, offset)?)
}

/// Asks the OS to forget `file`'s cached pages, so the next reads come from the disk (Linux
/// `posix_fadvise(DONTNEED)`; macOS `msync(MS_INVALIDATE)` over a mapping of the file).
pub fn drop_cached_pages(file: &File) -> io::Result<()> {
    os::drop_cached_pages(file)
}

/// Creates (truncating) `path` for sequential writes that bypass the page cache where the filesystem
/// allows; returns the file and whether it is uncached. Uncached writes on Linux must be whole
/// [`crate::DIRECT_ALIGN`] blocks from aligned memory; macOS has no such rule.
pub fn create_uncached(path: &Path) -> io::Result<(File, bool)> {
    os::create_uncached(path)
}

/// Turns a file from [`create_uncached`] back into an ordinary cached one.
pub fn set_cached(file: &File) -> io::Result<()> {
    os::set_cached(file)
}

/// Whether uncached writes to this file need block-aligned lengths and memory (Linux O_DIRECT).
pub const UNCACHED_WRITES_NEED_ALIGNMENT: bool = cfg!(target_os = "linux");

/// A fresh private, zero-filled, read-write anonymous mapping of `len` bytes, backed by huge pages where
/// the OS allows (Linux transparent huge pages); `None` if the OS refuses it.
pub fn map_zeroed(len: usize) -> Option<NonNull<u8>> {
    use nix::sys::mman::{mmap_anonymous, MapFlags, ProtFlags};
    let len = std::num::NonZeroUsize::new(len)?;
    // SAFETY: a fresh private anonymous mapping aliases nothing; the kernel zero-fills it on first touch.
    let ptr = unsafe {
        mmap_anonymous(
            None,
            len,
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::MAP_PRIVATE,
        )
    }
    .ok()?;
    os::advise_huge_pages(ptr, len.get());
    // Asked once per process: mappings are made many times (slots, 64 MiB chunks of resident weights, probes).
    static CHECKED: std::sync::Once = std::sync::Once::new();
    CHECKED.call_once(|| {
        if huge_pages() == Some(HugePages::Never) {
            tracing::warn!(
                "transparent huge pages are off (`never` in /sys/kernel/mm/transparent_hugepage/enabled): \
                 expert slots sit on 4 KiB pages, which uncached reads fill at half speed or less on some \
                 machines; \
                 `echo madvise > /sys/kernel/mm/transparent_hugepage/enabled` (as root) turns them on"
            )
        }
    });
    Some(ptr.cast())
}

/// Backs `len` bytes at `ptr` (page-aligned, inside a [`map_zeroed`] mapping) with memory now, leaving every
/// byte as it is, so a later first write does not stop to fault and zero pages; false where the OS cannot
/// (the pages then fault in on first touch as usual).
pub fn populate(ptr: NonNull<u8>, len: usize) -> bool {
    os::populate(ptr.cast(), len)
}

/// CPU time the calling thread has used so far (user and system); `None` where the OS does not say.
pub fn thread_cpu_time() -> Option<std::time::Duration> {
    // POSIX, the same call on Linux and macOS.
    #[cfg(unix)]
    {
        use nix::libc;
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: `ts` is a valid, writable timespec; the call writes only it.
        let ok = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0;
        ok.then(|| std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
    }
    #[cfg(not(unix))]
    None
}

/// Lets a write to a closed pipe end the process quietly, as command-line tools do (`sluice doctor | head`),
/// where Rust's runtime ignores SIGPIPE and `println!` then panics on the failed write. For commands whose
/// output is a report; never for a server, whose writes to a vanished client must fail, not end it.
pub fn exit_quietly_on_closed_pipe() {
    #[cfg(unix)]
    {
        use nix::libc;
        // SAFETY: restores SIGPIPE's default disposition; no handler of ours runs, no memory is touched.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
}

/// Unmaps a mapping made by [`map_zeroed`].
///
/// # Safety
/// `ptr` and `len` must be exactly one [`map_zeroed`] result and its length, and nothing may use the
/// memory afterwards.
pub unsafe fn unmap(ptr: NonNull<u8>, len: usize) {
    // SAFETY: the caller passes exactly one live mapping and never touches it again.
    let _ = unsafe { nix::sys::mman::munmap(ptr.cast(), len) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 64 GB M2 Max as `host_statistics64` gives it: `free_count` 1,904,640 pages, of which 61,440
    /// speculative (`vm_stat` would print 1,843,200 free and 61,440 speculative).
    const M2_MAX_64GB: VmPageCounts = VmPageCounts {
        free: 1_904_640,
        inactive: 812_345,
        purgeable: 24_576,
    };

    #[test]
    fn macos_available_memory_counts_reclaimable_pages() {
        let bytes = available_from_vm_pages(&M2_MAX_64GB, 16384);
        // The speculative pages once: they are inside `free_count` already.
        assert_eq!(bytes, (1_843_200 + 61_440 + 812_345 + 24_576) * 16384);
        // 44.9 GB of 64: the rest is wired, active and compressed.
        assert!((bytes as f64 / 1e9 - 44.92).abs() < 0.01, "{bytes}");
        assert_eq!(available_from_vm_pages(&VmPageCounts::default(), 16384), 0);
        let huge = VmPageCounts {
            free: u64::MAX,
            ..M2_MAX_64GB
        };
        assert_eq!(available_from_vm_pages(&huge, 16384), u64::MAX);
    }

    #[test]
    fn metal_default_working_set_is_three_quarters_above_36_gib() {
        assert_eq!(default_gpu_working_set(64 << 30), 48 << 30);
        assert_eq!(default_gpu_working_set(128 << 30), 96 << 30);
        assert_eq!(default_gpu_working_set(24 << 30), 16 << 30);
        assert_eq!(default_gpu_working_set(36 << 30), 24 << 30);
    }

    #[test]
    fn huge_page_bytes_are_summed_over_the_mappings_a_range_overlaps() {
        let smaps = "7f0000000000-7f0000400000 rw-p 00000000 00:00 0 \n\
                     Size:               4096 kB\n\
                     AnonHugePages:      2048 kB\n\
                     VmFlags: rd wr mr mw me ac hg\n\
                     7f0000400000-7f0000800000 rw-p 00000000 00:00 0 \n\
                     AnonHugePages:      4096 kB\n\
                     7f0000800000-7f0000a00000 r--p 00000000 08:01 42    /usr/lib/libc.so.6\n\
                     AnonHugePages:         0 kB\n";
        let mb = 1usize << 20;
        let base = 0x7f00_0000_0000usize;
        // Both anonymous mappings, not the library after them.
        assert_eq!(smaps_huge_page_bytes(smaps, base, base + 8 * mb), Some(6 << 20));
        // Only the second; a range shorter than its mapping's huge bytes is capped at its own length.
        assert_eq!(
            smaps_huge_page_bytes(smaps, base + 4 * mb, base + 8 * mb),
            Some(4 << 20)
        );
        assert_eq!(
            smaps_huge_page_bytes(smaps, base + 5 * mb, base + 6 * mb),
            Some(1 << 20)
        );
        // A mapping without huge pages, and an address nothing maps.
        assert_eq!(smaps_huge_page_bytes(smaps, base + 8 * mb, base + 9 * mb), Some(0));
        assert_eq!(smaps_huge_page_bytes(smaps, base + 16 * mb, base + 17 * mb), None);
        assert_eq!(smaps_huge_page_bytes("", base, base + mb), None);
    }

    #[test]
    fn this_process_reports_huge_pages_of_its_own_mappings_only() {
        let len = 8 << 20;
        let ptr = map_zeroed(len).expect("mapping");
        // SAFETY: `ptr..ptr+len` is the fresh mapping made above, written only here.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 1, len) };
        let got = huge_page_bytes(ptr.as_ptr() as usize, len);
        if cfg!(target_os = "linux") {
            // However many huge pages the kernel gave (none where they are off), never more than the range.
            assert!(got.is_some_and(|b| b <= len as u64), "{got:?}");
        } else {
            assert_eq!(got, None);
        }
        // SAFETY: the mapping made above, unmapped once.
        unsafe { unmap(ptr, len) };
    }

    #[test]
    fn the_selected_huge_page_setting_is_the_bracketed_word() {
        assert_eq!(parse_huge_pages("always [madvise] never\n"), Some(HugePages::Madvise));
        assert_eq!(parse_huge_pages("[always] madvise never"), Some(HugePages::Always));
        assert_eq!(parse_huge_pages("always madvise [never]"), Some(HugePages::Never));
        assert_eq!(parse_huge_pages("always madvise never"), None);
        assert_eq!(parse_huge_pages("always [inherit] never"), None);
        assert_eq!(parse_huge_pages(""), None);
    }

    #[test]
    fn meminfo_and_statm_parse() {
        let meminfo = "MemTotal:       24576000 kB\nMemFree:        1000 kB\nMemAvailable:   20480000 kB\n\
                       HugePages_Total:       0\n";
        assert_eq!(meminfo_bytes(meminfo, "MemAvailable"), Some(20_480_000 * 1024));
        assert_eq!(meminfo_bytes(meminfo, "MemTotal"), Some(24_576_000 * 1024));
        assert_eq!(meminfo_bytes(meminfo, "HugePages_Total"), Some(0));
        assert_eq!(meminfo_bytes(meminfo, "Mem"), None);
        assert_eq!(meminfo_bytes(meminfo, "SwapTotal"), None);
        assert_eq!(statm_resident_bytes("1000 250 30 1 0 200 0\n", 4096), Some(250 * 4096));
        assert_eq!(statm_resident_bytes("1000", 4096), None);
    }

    #[test]
    fn memory_cgroups_are_found_where_their_hierarchy_is_mounted() {
        use std::path::PathBuf;
        let at = |version, dir: &str, mount: &str| CgroupDir {
            version,
            dir: PathBuf::from(dir),
            mount: PathBuf::from(mount),
        };
        // A hybrid host (v1 controllers beside an empty unified hierarchy), as this project's VMs are.
        let mountinfo = "25 30 0:22 / /sys rw,nosuid shared:7 - sysfs sysfs rw\n\
                         33 25 0:28 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw,nsdelegate\n\
                         40 25 0:35 / /sys/fs/cgroup/memory rw,nosuid shared:20 - cgroup cgroup rw,memory\n\
                         41 25 0:36 / /sys/fs/cgroup/cpu,cpuacct rw shared:21 - cgroup cgroup rw,cpu,cpuacct\n";
        let cgroup = "9:cpu,cpuacct:/\n4:memory:/process_api/17567946\n0::/\n";
        assert_eq!(
            memory_cgroup_dirs(cgroup, mountinfo),
            [
                at(
                    CgroupVersion::V1,
                    "/sys/fs/cgroup/memory/process_api/17567946",
                    "/sys/fs/cgroup/memory"
                ),
                at(CgroupVersion::V2, "/sys/fs/cgroup/unified", "/sys/fs/cgroup/unified"),
            ]
        );
        // cgroup v2 only: a systemd service on the host, and a container that sees its cgroup as the root.
        let v2 = "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n";
        assert_eq!(
            memory_cgroup_dirs("0::/system.slice/sluice.service\n", v2),
            [at(
                CgroupVersion::V2,
                "/sys/fs/cgroup/system.slice/sluice.service",
                "/sys/fs/cgroup"
            )]
        );
        assert_eq!(
            memory_cgroup_dirs("0::/\n", v2),
            [at(CgroupVersion::V2, "/sys/fs/cgroup", "/sys/fs/cgroup")]
        );
        // A mount of part of the hierarchy (Docker on cgroup v1): the path below its root is under the mount
        // point; a path outside it, or one climbing out, is the mount point itself.
        let part = "50 40 0:35 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n";
        for (path, dir) in [
            ("/docker/abc", "/sys/fs/cgroup/memory"),
            ("/docker/abc/inner", "/sys/fs/cgroup/memory/inner"),
            ("/docker/abcdef", "/sys/fs/cgroup/memory"),
            ("/other", "/sys/fs/cgroup/memory"),
        ] {
            assert_eq!(
                memory_cgroup_dirs(&format!("4:memory:{path}\n"), part),
                [at(CgroupVersion::V1, dir, "/sys/fs/cgroup/memory")],
                "{path}"
            );
        }
        // Two mounts of the hierarchy: the one whose root holds the path.
        let two = "50 40 0:35 /other /mnt/a rw - cgroup2 none rw\n51 40 0:35 /docker /mnt/b rw - cgroup2 none rw\n";
        assert_eq!(
            memory_cgroup_dirs("0::/docker/c1\n", two),
            [at(CgroupVersion::V2, "/mnt/b/c1", "/mnt/b")]
        );
        let escaped = "50 40 0:35 / /mnt/my\\040cgroups rw - cgroup2 none rw\n";
        assert_eq!(
            memory_cgroup_dirs("0::/../x\n", escaped),
            [at(CgroupVersion::V2, "/mnt/my cgroups", "/mnt/my cgroups")]
        );
        // No memory hierarchy mounted, or nothing to read: none.
        assert_eq!(
            memory_cgroup_dirs(cgroup, "25 30 0:22 / /sys rw - sysfs sysfs rw\n"),
            []
        );
        assert_eq!(memory_cgroup_dirs("", mountinfo), []);
        assert_eq!(memory_cgroup_dirs("garbage\n::\n", "garbage\n"), []);

        assert_eq!(cgroup_limit("max\n"), None);
        assert_eq!(cgroup_limit("9223372036854771712\n"), None);
        assert_eq!(cgroup_limit("17179869184\n"), Some(16 << 30));
        assert_eq!(cgroup_limit(""), None);
        let stat = "anon 100\nfile 2048\ninactive_file 1024\ntotal_inactive_file 4096\n";
        assert_eq!(cgroup_stat(stat, "inactive_file"), Some(1024));
        assert_eq!(cgroup_stat(stat, "total_inactive_file"), Some(4096));
        assert_eq!(cgroup_stat(stat, "file_mapped"), None);
    }

    /// A cgroup's limit is the least set between its directory and the mount, and reclaimable file pages are
    /// not counted as used; read from files laid out as the kernel does.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_cgroup_limit_and_usage_are_read_from_its_files() {
        let tmp = tempfile::tempdir().unwrap();
        let write = |rel: &str, text: &str| {
            let p = tmp.path().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        };
        // v2: the parent's limit binds against the parent's usage (a sibling's 900 kB of it), less its file
        // pages; a tighter limit above the mount does not count.
        write("memory.max", "10\n");
        write("mnt/memory.max", "max\n");
        write("mnt/a/memory.max", "1000000\n");
        write("mnt/a/memory.current", "900000\n");
        write(
            "mnt/a/memory.stat",
            "anon 750000\ninactive_file 100000\nactive_file 50000\n",
        );
        write("mnt/a/b/memory.max", "max\n");
        write("mnt/a/b/memory.current", "600000\n");
        write(
            "mnt/a/b/memory.stat",
            "anon 350000\ninactive_file 200000\nactive_file 50000\n",
        );
        let at = |version, dir: &str, mount: &str| CgroupDir {
            version,
            dir: tmp.path().join(dir),
            mount: tmp.path().join(mount),
        };
        let v2 = at(CgroupVersion::V2, "mnt/a/b", "mnt");
        let got = os::cgroup_dir_memory(&v2).unwrap();
        assert_eq!((got.limit, got.available()), (1_000_000, 250_000));
        // A looser limit of its own with less room (400 kB against its 350 kB used) is the tighter room.
        write("mnt/a/b/memory.max", "400000\n");
        let got = os::cgroup_dir_memory(&v2).unwrap();
        assert_eq!((got.limit, got.available()), (400_000, 50_000));
        // `memory.high` below `memory.max` is the limit.
        write("mnt/a/b/memory.high", "380000\n");
        let got = os::cgroup_dir_memory(&v2).unwrap();
        assert_eq!((got.limit, got.available()), (380_000, 30_000));
        write("mnt/a/b/memory.high", "max\n");
        // No limit on the way up: none.
        write("mnt/a/memory.max", "max\n");
        write("mnt/a/b/memory.max", "max\n");
        assert_eq!(os::cgroup_dir_memory(&v2), None);
        // `memory.high` alone binds.
        write("mnt/a/memory.high", "700000\n");
        let got = os::cgroup_dir_memory(&v2).unwrap();
        assert_eq!((got.limit, got.available()), (700_000, 0));
        write("mnt/a/memory.high", "max\n");
        // v1: an unlimited own file, the hierarchy's limit from memory.stat.
        write("v1/g/memory.limit_in_bytes", "9223372036854771712\n");
        write("v1/g/memory.usage_in_bytes", "500000\n");
        write(
            "v1/g/memory.stat",
            "cache 100\nhierarchical_memory_limit 2000000\ninactive_file 7\ntotal_inactive_file 100000\n\
             total_active_file 50000\n",
        );
        let v1 = at(CgroupVersion::V1, "v1/g", "v1");
        let got = os::cgroup_dir_memory(&v1).unwrap();
        assert_eq!((got.limit, got.used), (2_000_000, 350_000));
        // Usage above the limit (reclaim pending) leaves nothing available, without wrapping.
        write("v1/g/memory.usage_in_bytes", "5000000\n");
        assert_eq!(os::cgroup_dir_memory(&v1).unwrap().available(), 0);
    }

    #[test]
    fn this_machine_answers_every_memory_question() {
        let MemoryNow {
            total,
            available: avail,
            ..
        } = memory_now().expect("total and available memory");
        assert!(avail > 0 && avail <= total, "available {avail} of {total}");
        let rss = resident_bytes().expect("resident bytes");
        let peak = peak_resident_bytes().expect("peak resident bytes");
        assert!(rss > 0 && rss <= total);
        // Linux keeps both numbers in per-CPU counters that are summed approximately, and the other tests'
        // threads allocate between the two reads: CI once saw the peak 58 pages under the resident size. A
        // wrong unit (KiB taken for bytes) would be off by 1024×, which this margin still catches.
        assert!(peak + (16 << 20) >= rss, "peak {peak} < now {rss}");
        assert!(peak <= total, "peak {peak} of {total}");
        #[cfg(target_os = "linux")]
        {
            // The same number the kernel gives, give or take what moved in between (a busy neighbour can
            // move hundreds of MB of page cache between two reads: ask a few times).
            let close = (0..5).any(|_| {
                let text = std::fs::read_to_string("/proc/meminfo").unwrap();
                let want = meminfo_bytes(&text, "MemAvailable").unwrap();
                let now = memory_now().unwrap();
                let want = now.cgroup.map_or(want, |cg| want.min(cg.available()));
                now.available.abs_diff(want) < 256 << 20
            });
            assert!(
                close,
                "available memory never within 256 MB of MemAvailable (or the memory cgroup's room)"
            );
            // Physical memory, or the memory cgroup's limit where that is less.
            let text = std::fs::read_to_string("/proc/meminfo").unwrap();
            let physical = meminfo_bytes(&text, "MemTotal").unwrap();
            let cgroup = memory_now().unwrap().cgroup;
            assert_eq!(total, cgroup.map_or(physical, |cg| physical.min(cg.limit)));
            assert_eq!(gpu_working_set_limit(), None);
        }
        #[cfg(target_os = "macos")]
        assert!(gpu_working_set_limit().is_some_and(|g| g <= total));
    }

    #[test]
    fn dropping_cached_pages_and_uncached_files_work_here() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, vec![7u8; 1 << 16]).unwrap();
        let f = open_for_reads(&path, false).unwrap();
        drop_cached_pages(&f).unwrap();
        let mut buf = vec![0u8; 100];
        assert_eq!(read_at(&f, &mut buf, (1 << 16) - 50).unwrap(), 50);
        assert!(buf[..50].iter().all(|&b| b == 7));
        // tmpfs refuses O_DIRECT; a real filesystem accepts it. Either way the error (if any) is an io::Error.
        let _ = open_for_reads(&path, true);
        let (w, _) = create_uncached(&dir.path().join("out")).unwrap();
        set_cached(&w).unwrap();
    }

    #[test]
    fn a_threads_cpu_time_grows_with_its_work_alone() {
        let Some(before) = thread_cpu_time() else {
            // Linux and macOS both have a per-thread clock; other systems may not.
            #[cfg(any(target_os = "linux", target_os = "macos"))]
            panic!("no per-thread CPU clock");
            #[cfg(not(any(target_os = "linux", target_os = "macos")))]
            return;
        };
        // Busy until the clock shows 5 ms of work (a loaded machine may give this thread little of the wall
        // time), within 10 s: a clock that does not count this thread's work never gets there.
        let wall = std::time::Instant::now();
        let mut x = 1u64;
        let mut used = std::time::Duration::ZERO;
        while used < std::time::Duration::from_millis(5) && wall.elapsed() < std::time::Duration::from_secs(10) {
            for _ in 0..10_000 {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
            used = thread_cpu_time().unwrap() - before;
        }
        assert!(
            used >= std::time::Duration::from_millis(5) && used <= wall.elapsed() + std::time::Duration::from_millis(5),
            "{used:?} of CPU in {:?} of a busy loop",
            wall.elapsed()
        );
        // Another thread sleeping meanwhile uses next to none.
        let idle = std::thread::spawn(|| {
            let t0 = thread_cpu_time().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
            thread_cpu_time().unwrap() - t0
        });
        let idle = idle.join().unwrap();
        assert!(
            idle < std::time::Duration::from_millis(5),
            "a sleeping thread used {idle:?}"
        );
    }

    #[test]
    fn anonymous_mappings_are_zeroed_and_writable() {
        let len = 3 << 20;
        let p = map_zeroed(len).unwrap();
        // SAFETY: `p` is a fresh mapping of `len` bytes, unmapped only below.
        let s = unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), len) };
        assert!(s.iter().all(|&b| b == 0));
        s.fill(1);
        // SAFETY: exactly the mapping above; `s` is not used again.
        unsafe { unmap(p, len) };
    }
}
