//! Where each expert record's bytes live on disk and where they land in a slot.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::{Checkpoint, StackedExperts, StoreError};

/// Alignment O_DIRECT reads need for offset, length and buffer on the filesystems we target.
pub const DIRECT_ALIGN: u64 = 4096;

/// The largest single read the engine issues: a longer one (a packed record, a large tensor slice in place) is
/// cut into equal pieces of at most this size ([`piece_len`]) read side by side. On this VM's disk three ~0.9 MB
/// reads side by side read a 2.65 MB record 9–15% faster than one read (`docs/performance-log.md`, the
/// twenty-sixth session); an NVMe drive serves pieces in parallel.
pub const READ_PIECE: usize = 1 << 20;

/// Alignment of each part inside a slot when reads are buffered (enough for any SIMD load).
pub(crate) const PART_ALIGN: usize = 64;

/// A file that can be read at an offset from several threads (the seam for fault injection in tests).
pub trait ReadAt: Send + Sync {
    /// Reads up to `buf.len()` bytes at `offset`; returns how many (0 at end of file).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    /// The file's path, for error messages.
    fn path(&self) -> &Path;
    /// Asks the OS to drop this file's cached pages (for cold-cache benchmarks); best effort.
    fn drop_os_cache(&self) -> io::Result<()> {
        Ok(())
    }
}

/// A file read with `pread`, optionally bypassing the page cache.
pub struct PosixFile {
    file: File,
    path: PathBuf,
}

impl PosixFile {
    /// Opens `path` read-only; `direct` bypasses the page cache (O_DIRECT on Linux, F_NOCACHE on macOS).
    pub fn open(path: &Path, direct: bool) -> Result<Self, StoreError> {
        let file = crate::platform::open_for_reads(path, direct).map_err(|source| StoreError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Self {
            file,
            path: path.to_path_buf(),
        })
    }

    /// The file's metadata now.
    pub fn metadata(&self) -> Result<std::fs::Metadata, StoreError> {
        self.file.metadata().map_err(|source| StoreError::Io {
            path: self.path.clone(),
            source,
        })
    }
}

impl ReadAt for PosixFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        crate::platform::read_at(&self.file, buf, offset)
    }
    fn path(&self) -> &Path {
        &self.path
    }
    fn drop_os_cache(&self) -> io::Result<()> {
        crate::platform::drop_cached_pages(&self.file)
    }
}

/// Reads exactly `buf.len()` bytes at `offset`, retrying short reads; fewer bytes only once `allow_eof_after`
/// bytes have been read (the tail of an O_DIRECT-aligned read, which may run past the end of the file).
pub fn read_full(f: &dyn ReadAt, buf: &mut [u8], offset: u64, allow_eof_after: usize) -> io::Result<usize> {
    let mut done = 0;
    let want = buf.len();
    let short = |done: usize| {
        io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("short read: {done} of {want} bytes at offset {offset} (the file ends there)"),
        )
    };
    while done < want {
        match f.read_at(&mut buf[done..], offset + done as u64) {
            // A short read (or none) once every byte needed is in is the end of the file: asking again at the
            // unaligned offset it stopped at fails under O_DIRECT on filesystems that check alignment first.
            Ok(n) if done + n >= allow_eof_after && done + n < want => {
                done += n;
                break;
            }
            Ok(0) => return Err(short(done)),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // An aligned direct read that came back short ended at the end of the file (a truncated one): the
            // retry at the unaligned offset it stopped at is refused, which says less than the short read.
            Err(e) if done > 0 && e.kind() == io::ErrorKind::InvalidInput => return Err(short(done)),
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// One positional read of a record: `len` bytes of file `file` at `offset` into the slot at `slot_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadOp {
    /// Index into [`RecordTable::files`].
    pub file: usize,
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes to read.
    pub len: usize,
    /// Where in the slot they go.
    pub slot_offset: usize,
    /// Bytes that must exist (the rest of `len` may run past the end of the file).
    pub needed: usize,
}

/// How to load one record into a slot and where its parts are once loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordLayout {
    /// The reads that fill the slot (one for a packed record, one per part in place).
    pub reads: Vec<ReadOp>,
    /// Each part's (offset, length) in the slot, in record order.
    pub parts: Vec<(usize, usize)>,
    /// xxh3-64 of the bytes of the single read, when the store keeps checksums.
    pub checksum: Option<u64>,
    /// Where the parts are once the table's [`RecordTransform`] has rewritten the slot (`None`: at `parts`).
    pub rewritten: Option<Vec<(usize, usize)>>,
}

/// The length of the pieces a read of `len` bytes is cut into: as few pieces of at most [`READ_PIECE`] as
/// cover it, of one length rounded up to whole blocks (the last one shorter). Equal pieces land together.
pub fn piece_len(len: usize) -> usize {
    let pieces = len.div_ceil(READ_PIECE).max(1);
    len.div_ceil(pieces).next_multiple_of(DIRECT_ALIGN as usize)
}

impl ReadOp {
    /// This read cut into pieces of [`piece_len`] bytes, in order, each with its share of `needed`.
    pub fn pieces(&self) -> impl Iterator<Item = ReadOp> + '_ {
        // At least 1: an empty read is no pieces, not a division by zero.
        let piece = piece_len(self.len).max(1);
        (0..self.len.div_ceil(piece)).map(move |k| {
            let at = k * piece;
            let len = piece.min(self.len - at);
            ReadOp {
                offset: self.offset + at as u64,
                len,
                slot_offset: self.slot_offset + at,
                needed: self.needed.saturating_sub(at).min(len),
                ..*self
            }
        })
    }
}

impl RecordLayout {
    /// Slot bytes this record occupies.
    pub fn slot_len(&self) -> usize {
        self.reads.iter().map(|r| r.slot_offset + r.len).max().unwrap_or(0)
    }

    /// Bytes read from disk to load it.
    pub fn read_len(&self) -> usize {
        self.reads.iter().map(|r| r.len).sum()
    }

    /// Where the parts are once the record is loaded (after any rewrite).
    pub fn loaded_parts(&self) -> &[(usize, usize)] {
        self.rewritten.as_deref().unwrap_or(&self.parts)
    }
}

/// Rewrites records into their slots after each read lands and passes its checksum, e.g. into the layout a
/// compute kernel wants: the engine's I/O threads do it once per read, so the decode step only ever sees the
/// rewritten layout, and the file keeps the layout every backend reads. (`convert` can also apply one as it
/// writes a store: [`crate::ConvertOptions::rewrite`].)
pub trait RecordTransform: Send + Sync {
    /// Where the parts of `layer`'s records go, given where they are as read (`None`: they stay as read).
    fn parts(&self, layer: usize, read: &[(usize, usize)]) -> Option<Vec<(usize, usize)>>;

    /// Writes one record of `layer` into `slot` at `to`, from `record` (the record as read, in a buffer of
    /// its own laid out as the slot would have been), whose parts are at `from`. Slot bytes outside `to` are
    /// left as they were.
    fn apply(
        &self,
        layer: usize,
        record: &[u8],
        from: &[(usize, usize)],
        slot: &mut [u8],
        to: &[(usize, usize)],
    ) -> Result<(), String>;
}

/// Every record of a model: the files and, per layer, one layout per expert.
pub struct RecordTable {
    /// The files reads refer to.
    pub files: Vec<Arc<dyn ReadAt>>,
    layers: HashMap<usize, Vec<RecordLayout>>,
    transform: Option<Arc<dyn RecordTransform>>,
}

impl RecordTable {
    /// A table from parts: `files` and `(layer, per-expert layouts)`.
    pub fn new(files: Vec<Arc<dyn ReadAt>>, layers: HashMap<usize, Vec<RecordLayout>>) -> Self {
        Self {
            files,
            layers,
            transform: None,
        }
    }

    /// This table with every record `transform` takes rewritten after its read; errors when a rewritten
    /// record would not fit the slot bytes its reads use.
    pub fn with_transform(mut self, transform: Arc<dyn RecordTransform>) -> Result<Self, StoreError> {
        for (&layer, records) in &mut self.layers {
            for (expert, r) in records.iter_mut().enumerate() {
                let Some(to) = transform.parts(layer, &r.parts) else {
                    continue;
                };
                if to.iter().any(|&(off, len)| off + len > r.slot_len()) {
                    return Err(StoreError::Engine(format!(
                        "layer {layer} expert {expert}: the rewritten record needs more than its {} slot bytes",
                        r.slot_len()
                    )));
                }
                r.rewritten = Some(to);
            }
        }
        self.transform = Some(transform);
        Ok(self)
    }

    /// The rewrite applied to records after their reads, if any.
    pub fn transform(&self) -> Option<&Arc<dyn RecordTransform>> {
        self.transform.as_ref()
    }

    /// Records straight from the stacked tensors of the original safetensors: one read per part.
    pub fn in_place(ckpt: &Checkpoint, stacks: &[StackedExperts], direct: bool) -> Result<Self, StoreError> {
        let mut file_ids: HashMap<PathBuf, usize> = HashMap::new();
        let mut files: Vec<Arc<dyn ReadAt>> = Vec::new();
        let mut layers = HashMap::new();
        for s in stacks {
            let mut comps = Vec::new();
            for name in &s.tensors {
                let (t, stride) = s.part(ckpt, name)?;
                let id = match file_ids.get(&t.file) {
                    Some(&id) => id,
                    None => {
                        files.push(Arc::new(PosixFile::open(&t.file, direct)?));
                        file_ids.insert(t.file.clone(), files.len() - 1);
                        files.len() - 1
                    }
                };
                comps.push((id, t.offset, stride));
            }
            let records = (0..s.num_experts)
                .map(|e| {
                    let mut cursor = 0usize;
                    let mut reads = Vec::new();
                    let mut parts = Vec::new();
                    for &(file, base, stride) in &comps {
                        let offset = base + (e * stride) as u64;
                        let (start, lead, len) = if direct {
                            let start = offset / DIRECT_ALIGN * DIRECT_ALIGN;
                            let lead = (offset - start) as usize;
                            (
                                start,
                                lead,
                                (lead + stride).div_ceil(DIRECT_ALIGN as usize) * DIRECT_ALIGN as usize,
                            )
                        } else {
                            (offset, 0, stride)
                        };
                        let align = if direct { DIRECT_ALIGN as usize } else { PART_ALIGN };
                        cursor = cursor.div_ceil(align) * align;
                        reads.push(ReadOp {
                            file,
                            offset: start,
                            len,
                            slot_offset: cursor,
                            needed: lead + stride,
                        });
                        parts.push((cursor + lead, stride));
                        cursor += len;
                    }
                    RecordLayout {
                        reads,
                        parts,
                        checksum: None,
                        rewritten: None,
                    }
                })
                .collect();
            layers.insert(s.layer, records);
        }
        Ok(Self::new(files, layers))
    }

    /// The layout of expert `expert` in layer `layer`.
    pub fn record(&self, layer: usize, expert: usize) -> Option<&RecordLayout> {
        self.layers.get(&layer)?.get(expert)
    }

    /// Experts in `layer` (0 when the layer has none).
    pub fn num_experts(&self, layer: usize) -> usize {
        self.layers.get(&layer).map_or(0, Vec::len)
    }

    /// Layers that have records, ascending.
    pub fn layers(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.layers.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// The most reads of at most [`READ_PIECE`] bytes any one record takes.
    pub fn max_pieces_per_record(&self) -> usize {
        (self.layers.values().flatten())
            .map(|l| l.reads.iter().map(|r| r.pieces().count()).sum::<usize>())
            .max()
            .unwrap_or(0)
    }

    /// The largest slot any record needs.
    pub fn max_slot_len(&self) -> usize {
        self.layers
            .values()
            .flatten()
            .map(RecordLayout::slot_len)
            .max()
            .unwrap_or(0)
    }

    /// Total bytes read to load every record once.
    pub fn total_read_bytes(&self) -> u64 {
        self.layers.values().flatten().map(|r| r.read_len() as u64).sum()
    }

    /// Reads the first piece of one record into an aligned buffer and drops it: a filesystem that accepts
    /// O_DIRECT at open but refuses the reads themselves (`EINVAL`) says so here, before a generation needs a
    /// record. No record: nothing to read.
    pub fn probe_read(&self) -> io::Result<()> {
        let Some(op) = (self.layers.values().flatten())
            .find_map(|r| r.reads.first())
            .and_then(|r| r.pieces().next())
        else {
            return Ok(());
        };
        let file = self
            .files
            .get(op.file)
            .ok_or_else(|| io::Error::other("a read names no file"))?;
        let mut buf = (crate::aligned::SlotBuf::allocate(1, op.len).and_then(|mut b| b.pop()))
            .ok_or_else(|| io::Error::other("no memory for a probe read"))?;
        read_full(&**file, &mut buf.as_mut_slice()[..op.len], op.offset, op.needed).map(|_| ())
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.layers.values().map(Vec::len).sum()
    }

    /// True when the table has no records.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of `len` bytes read as O_DIRECT reads it where alignment is checked before the end of the file:
    /// an unaligned offset or length is EINVAL, and a read at the end comes back short.
    struct DirectFile {
        len: u64,
    }

    impl ReadAt for DirectFile {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
            if !offset.is_multiple_of(4096) || !buf.len().is_multiple_of(4096) {
                return Err(io::Error::from_raw_os_error(22));
            }
            let n = (self.len.saturating_sub(offset) as usize).min(buf.len());
            buf[..n].fill(7);
            Ok(n)
        }
        fn path(&self) -> &Path {
            Path::new("direct")
        }
    }

    #[test]
    fn an_aligned_read_past_the_end_of_the_file_ends_where_the_file_does() {
        // The last tensor ends 1000 bytes into the file's last block; the read covers two blocks.
        let f = DirectFile { len: 4096 + 1000 };
        let mut buf = vec![0u8; 8192];
        assert_eq!(read_full(&f, &mut buf, 0, 4096 + 1000).unwrap(), 5096);
        assert!(buf[..5096].iter().all(|&b| b == 7));
        // Bytes that must exist and do not are still an error.
        let mut buf = vec![0u8; 8192];
        let e = read_full(&DirectFile { len: 4096 }, &mut buf, 0, 5000).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
        // A file cut short mid-block (truncated under a server): the short read, not the refused retry, is the
        // error.
        let e = read_full(&DirectFile { len: 5000 }, &mut buf, 0, 8192).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
        assert!(e.to_string().contains("short read: 5000 of 8192 bytes"), "{e}");
    }

    #[test]
    fn a_read_cut_into_pieces_covers_it_in_order_and_shares_out_what_must_exist() {
        // 2.5 MiB and a block: three equal pieces (the last shorter); only the first 1.25 MiB must exist (the
        // rest may run past the end of the file).
        let mib = READ_PIECE;
        let r = ReadOp {
            file: 2,
            offset: 8192,
            len: 2 * mib + mib / 2 + 4096,
            slot_offset: 4096,
            needed: mib + mib / 4,
        };
        let piece = piece_len(r.len);
        assert_eq!(piece, (r.len.div_ceil(3)).next_multiple_of(4096));
        assert!(piece <= READ_PIECE && piece.is_multiple_of(4096));
        let got: Vec<ReadOp> = r.pieces().collect();
        let want = |k: usize, len: usize, needed: usize| ReadOp {
            file: 2,
            offset: 8192 + (k * piece) as u64,
            len,
            slot_offset: 4096 + k * piece,
            needed,
        };
        let last = r.len - 2 * piece;
        assert_eq!(
            got,
            vec![
                want(0, piece, piece),
                want(1, piece, r.needed - piece),
                want(2, last, 0)
            ]
        );
        // An empty read is no pieces (it divided by zero).
        let empty = ReadOp { len: 0, needed: 0, ..r };
        assert_eq!(empty.pieces().count(), 0);
        let short = ReadOp {
            len: READ_PIECE,
            needed: 10,
            ..r
        };
        assert_eq!(
            short.pieces().collect::<Vec<_>>(),
            vec![short],
            "a read no longer than a piece stays whole"
        );
    }
}
