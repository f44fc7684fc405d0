//! The packed store: one contiguous, 16 KiB-aligned record per (layer, expert) in `experts.bin`, described
//! by a versioned manifest `sluice-store.json` with a checksum per record. Non-expert weights and the
//! tokenizer stay in the original model directory, which the manifest references. A layer's records may be
//! stored rewritten (e.g. into the layout a compute kernel wants, see [`ConvertOptions::rewrite`]): the
//! manifest then names that layout and where each rewritten part lies, and such a store is version 2, which
//! builds that cannot tell layouts apart refuse.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::aligned::SLOT_ALIGN;
use crate::layout::{read_full, PosixFile, ReadAt, ReadOp, RecordLayout, RecordTable};
use crate::{Checkpoint, StackedExperts, StoreError};

/// File name of the manifest inside a store directory.
pub const MANIFEST_FILE: &str = "sluice-store.json";
/// File name of the record data inside a store directory.
pub const DATA_FILE: &str = "experts.bin";
/// The manifest's `format` field.
const FORMAT: &str = "sluice-expert-store";
/// Newest manifest version this build reads: 1 (records as the checkpoint holds them) or 2 (some layers'
/// records stored rewritten, see [`LayerManifest::layout`]).
pub const STORE_VERSION: u32 = 2;
/// Alignment of each part inside a record (the same as in an in-place slot).
const PART_ALIGN: u64 = crate::layout::PART_ALIGN as u64;

/// The manifest of a packed store.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    /// Always `sluice-expert-store`.
    pub format: String,
    /// Layout version.
    pub version: u32,
    /// The model directory holding config, tokenizer and non-expert weights.
    pub model_dir: PathBuf,
    /// Record data file, relative to the store directory.
    pub data_file: String,
    /// Exact length of the data file.
    pub data_len: u64,
    /// Alignment of every record's offset and length.
    pub record_align: u64,
    /// Checksum algorithm of the records (`xxh3-64`).
    pub checksum: String,
    /// One entry per MoE layer.
    pub layers: Vec<LayerManifest>,
}

/// The records of one layer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LayerManifest {
    /// Layer index.
    pub layer: usize,
    /// Stored record length (padded).
    pub record_len: u64,
    /// The tensors each record holds a slice of, in record order (for a rewritten layer: the slices it was
    /// written from, at their places before the rewrite).
    pub parts: Vec<PartManifest>,
    /// The layout the records were rewritten into when written, as the rewrite names it (e.g. `tiled-p1`);
    /// `None`: each record holds its `parts` as they are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<String>,
    /// Where a rewritten record's parts lie in it, as (offset, length) (`None` exactly when `layout` is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_parts: Option<Vec<(u64, u64)>>,
    /// One per expert, by expert index.
    pub records: Vec<RecordManifest>,
    /// xxh3-64 of a sample of the checkpoint's bytes this layer was converted from (see [`source_sample`]),
    /// as 16 hex digits; opening checks it against the model directory, which may have changed since
    /// (stores from before it have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_sample: Option<String>,
}

/// Bytes of each of a layer's source tensors that [`source_sample`] hashes.
const SOURCE_SAMPLE_BYTES: usize = 4096;

/// A fingerprint of the checkpoint bytes a layer's records come from, cheap enough to take at every load: the
/// first [`SOURCE_SAMPLE_BYTES`] of expert 0 in each stacked tensor. A model directory updated after
/// `convert` (a new revision, a fine-tune, a re-quantization with the same shapes) changes them, while the
/// store's own checksums would still pass and its stale experts would silently mix with new weights.
fn source_sample(ckpt: &Checkpoint, s: &StackedExperts) -> Result<String, StoreError> {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for name in &s.tensors {
        let (t, stride) = s.part(ckpt, name)?;
        h.update(&t.bytes()[..stride.min(SOURCE_SAMPLE_BYTES)]);
    }
    Ok(format!("{:016x}", h.digest()))
}

/// One component tensor of a record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartManifest {
    /// Stacked tensor name in the model's safetensors.
    pub tensor: String,
    /// Its dtype as safetensors spells it.
    pub dtype: String,
    /// Its stacked shape (experts first).
    pub shape: Vec<usize>,
    /// Offset of this part inside the record.
    pub offset: u64,
    /// Bytes of one expert's slice.
    pub len: u64,
}

/// Where one record is and what it hashes to.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecordManifest {
    /// Offset in the data file.
    pub offset: u64,
    /// xxh3-64 of all `record_len` stored bytes, padding included, as 16 hex digits.
    pub xxh3: String,
}

/// An opened, validated packed store.
pub struct PackedStore {
    dir: PathBuf,
    manifest: Manifest,
    /// When the data file was last written, as `open` found it.
    data_modified: Option<std::time::SystemTime>,
}

fn bad(path: &Path, message: impl Into<String>) -> StoreError {
    StoreError::BadStore {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// True when `dir` holds a packed store manifest.
pub fn is_store(dir: &Path) -> bool {
    dir.join(MANIFEST_FILE).is_file()
}

fn parse_hash(s: &str) -> Option<u64> {
    (s.len() == 16).then(|| u64::from_str_radix(s, 16).ok()).flatten()
}

impl PackedStore {
    /// Opens the store in `dir`, checking the manifest's structure and the data file's length.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let mpath = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&mpath).map_err(io_err(&mpath))?;
        let manifest: Manifest =
            serde_json::from_str(&text).map_err(|e| bad(&mpath, format!("not a valid store manifest: {e}")))?;
        if manifest.format != FORMAT {
            return Err(bad(
                &mpath,
                format!("format is `{}`, expected `{FORMAT}`", manifest.format),
            ));
        }
        if !(1..=STORE_VERSION).contains(&manifest.version) {
            return Err(bad(
                &mpath,
                format!(
                    "store version {} is not supported by this build (version {STORE_VERSION}); convert again",
                    manifest.version
                ),
            ));
        }
        if manifest.checksum != "xxh3-64" || manifest.record_align == 0 || !manifest.record_align.is_multiple_of(4096) {
            return Err(bad(&mpath, "unsupported checksum or record alignment"));
        }
        let dpath = dir.join(&manifest.data_file);
        let meta = std::fs::metadata(&dpath).map_err(io_err(&dpath))?;
        let (len, data_modified) = (meta.len(), meta.modified().ok());
        if len != manifest.data_len {
            return Err(bad(
                &dpath,
                format!(
                    "is {len} bytes, the manifest says {} (truncated or replaced?)",
                    manifest.data_len
                ),
            ));
        }
        // Records lie one after another from the file's start, layer by layer, as `convert` writes them: an
        // entry moved or swapped with another (checksum and all) would serve another expert's bytes.
        let mut next_record = 0u64;
        let mut seen = std::collections::HashSet::new();
        for l in &manifest.layers {
            let at = |what: String| bad(&mpath, format!("layer {}: {what}", l.layer));
            if !seen.insert(l.layer) {
                return Err(at("is listed twice".into()));
            }
            // `convert` lists only layers with experts; an empty one would still have `verify` size a buffer by
            // its record length, up to the whole data file.
            if l.records.is_empty() {
                return Err(at("lists no records".into()));
            }
            if !l.record_len.is_multiple_of(manifest.record_align) {
                return Err(at(format!("record length {} is not aligned", l.record_len)));
            }
            // Bounded by the data file: a reader sizes buffers by it.
            if l.record_len > manifest.data_len {
                return Err(at(format!(
                    "record length {} exceeds the data file's {} bytes",
                    l.record_len, manifest.data_len
                )));
            }
            for p in &l.parts {
                if p.offset.checked_add(p.len).is_none_or(|end| end > l.record_len) {
                    return Err(at(format!("part `{}` lies outside the record", p.tensor)));
                }
            }
            match (&l.layout, &l.stored_parts) {
                (None, None) => {}
                (Some(_), Some(_)) if manifest.version < 2 => {
                    return Err(at(
                        "names a rewritten layout, which a version 1 store cannot hold".into()
                    ))
                }
                (Some(_), Some(stored)) => {
                    if (stored.iter()).any(|&(off, len)| off.checked_add(len).is_none_or(|end| end > l.record_len)) {
                        return Err(at("a rewritten part lies outside the record".into()));
                    }
                }
                _ => return Err(at("`layout` and `stored_parts` come together".into())),
            }
            for (e, r) in l.records.iter().enumerate() {
                if !r.offset.is_multiple_of(manifest.record_align)
                    || r.offset
                        .checked_add(l.record_len)
                        .is_none_or(|end| end > manifest.data_len)
                    || parse_hash(&r.xxh3).is_none()
                {
                    return Err(at(format!("record of expert {e} has a bad offset or checksum field")));
                }
                if r.offset != next_record {
                    return Err(at(format!(
                        "record of expert {e} is at offset {}, where the one before it ends at {next_record}",
                        r.offset
                    )));
                }
                next_record += l.record_len;
            }
        }
        if next_record != manifest.data_len {
            return Err(bad(
                &mpath,
                format!(
                    "its records end at byte {next_record} of a {}-byte data file",
                    manifest.data_len
                ),
            ));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
            data_modified,
        })
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The store directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path of the record data file.
    pub fn data_path(&self) -> PathBuf {
        self.dir.join(&self.manifest.data_file)
    }

    /// The model directory with config, tokenizer and non-expert weights (relative paths resolve from the
    /// store directory).
    pub fn model_dir(&self) -> PathBuf {
        self.dir.join(&self.manifest.model_dir)
    }

    /// Checks that the manifest describes exactly the experts `stacks` of `ckpt` (names, dtypes, shapes).
    pub fn check_against(&self, ckpt: &Checkpoint, stacks: &[StackedExperts]) -> Result<(), StoreError> {
        let mpath = self.dir.join(MANIFEST_FILE);
        let by_layer: HashMap<usize, &LayerManifest> = self.manifest.layers.iter().map(|l| (l.layer, l)).collect();
        if by_layer.len() != stacks.len() {
            return Err(bad(
                &mpath,
                format!(
                    "has {} expert layers, the model has {}; it was converted from another model",
                    by_layer.len(),
                    stacks.len()
                ),
            ));
        }
        for s in stacks {
            let l = by_layer.get(&s.layer).ok_or_else(|| {
                bad(
                    &mpath,
                    format!("has no layer {}; it was converted from another model", s.layer),
                )
            })?;
            let want = expected_parts(ckpt, s)?;
            // Offsets too: an edited one would slice a record wrongly while its checksum still matched.
            type Part<'a> = (&'a str, &'a str, &'a [usize], u64, u64);
            let got: Vec<Part> = (l.parts.iter())
                .map(|p| (p.tensor.as_str(), p.dtype.as_str(), p.shape.as_slice(), p.offset, p.len))
                .collect();
            let want: Vec<Part> = (want.iter())
                .map(|p| (p.tensor.as_str(), p.dtype.as_str(), p.shape.as_slice(), p.offset, p.len))
                .collect();
            if got != want || l.records.len() != s.num_experts {
                return Err(bad(
                    &mpath,
                    format!(
                        "layer {} disagrees with the model: store has {} experts of {:?}, model has {} of {:?}",
                        s.layer,
                        l.records.len(),
                        got,
                        s.num_experts,
                        want
                    ),
                ));
            }
            if let Some(sample) = &l.source_sample {
                if *sample != source_sample(ckpt, s)? {
                    return Err(bad(
                        &mpath,
                        format!(
                            "layer {}'s experts in {} differ from those the store was converted from: the model \
                             directory changed since `sluice convert`; convert it again (--force replaces the store)",
                            s.layer,
                            ckpt.dir().display()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The record table for the engine; `direct` opens the data file with O_DIRECT / F_NOCACHE.
    pub fn table(&self, direct: bool) -> Result<RecordTable, StoreError> {
        let path = self.data_path();
        let file = PosixFile::open(&path, direct)?;
        // The file checked at `open` may have been replaced since (a `convert --force` racing this load): other
        // records, which would fail each first read's checksum one at a time.
        let meta = file.metadata()?;
        let (len, modified) = (meta.len(), meta.modified().ok());
        if len != self.manifest.data_len || modified != self.data_modified {
            return Err(bad(
                &path,
                format!(
                    "was replaced since the store was opened (now {len} bytes, the manifest says {}); open it again",
                    self.manifest.data_len
                ),
            ));
        }
        self.table_over(Arc::new(file))
    }

    /// The record table reading through `file` (tests inject faults here).
    pub fn table_over(&self, file: Arc<dyn ReadAt>) -> Result<RecordTable, StoreError> {
        let mut layers = HashMap::new();
        for l in &self.manifest.layers {
            let parts: Vec<(usize, usize)> = match &l.stored_parts {
                Some(stored) => stored.iter().map(|&(off, len)| (off as usize, len as usize)).collect(),
                None => l.parts.iter().map(|p| (p.offset as usize, p.len as usize)).collect(),
            };
            let records = (l.records.iter())
                .map(|r| RecordLayout {
                    reads: vec![ReadOp {
                        file: 0,
                        offset: r.offset,
                        len: l.record_len as usize,
                        slot_offset: 0,
                        needed: l.record_len as usize,
                    }],
                    parts: parts.clone(),
                    checksum: parse_hash(&r.xxh3),
                    rewritten: None,
                })
                .collect();
            layers.insert(l.layer, records);
        }
        Ok(RecordTable::new(vec![file], layers))
    }

    /// Reads every record from the disk and checks its checksum; `progress` gets bytes done. Returns the bad
    /// records as messages naming layer, expert and offset (empty when all are intact).
    pub fn verify(&self, progress: &dyn Fn(u64)) -> Result<Vec<String>, StoreError> {
        let path = self.data_path();
        // The disk's bytes, not the page cache's: right after `convert` wrote them through it, the cache would
        // only hand back what was written. (Best effort: where the OS will not drop them, the cache is read.)
        if let Ok(f) = File::open(&path) {
            let _ = crate::platform::drop_cached_pages(&f);
        }
        let file = PosixFile::open(&path, false)?;
        let mut buf = Vec::new();
        let mut bad_records = Vec::new();
        for l in &self.manifest.layers {
            buf.resize(l.record_len as usize, 0);
            for (e, r) in l.records.iter().enumerate() {
                read_full(&file, &mut buf, r.offset, l.record_len as usize).map_err(io_err(&path))?;
                let got = xxhash_rust::xxh3::xxh3_64(&buf);
                if Some(got) != parse_hash(&r.xxh3) {
                    bad_records.push(format!(
                        "layer {} expert {e} at offset {}: checksum {got:016x}, manifest says {}",
                        l.layer, r.offset, r.xxh3
                    ));
                }
                progress(l.record_len);
            }
        }
        Ok(bad_records)
    }
}

/// The parts a record of `s` holds, with offsets packed at [`PART_ALIGN`].
fn expected_parts(ckpt: &Checkpoint, s: &StackedExperts) -> Result<Vec<PartManifest>, StoreError> {
    let mut offset = 0u64;
    let mut parts = Vec::new();
    for name in &s.tensors {
        let (t, stride) = s.part(ckpt, name)?;
        offset = offset.div_ceil(PART_ALIGN) * PART_ALIGN;
        let len = stride as u64;
        parts.push(PartManifest {
            tensor: name.clone(),
            dtype: format!("{:?}", t.dtype),
            shape: t.shape.clone(),
            offset,
            len,
        });
        offset += len;
    }
    Ok(parts)
}

/// Options of [`convert`].
pub struct ConvertOptions<'a> {
    /// Replace an existing store in the output directory.
    pub force: bool,
    /// Called with bytes written so far and the total.
    pub progress: &'a dyn Fn(u64, u64),
    /// Records of the layers this transform takes are stored rewritten by it, under the layout name given
    /// (the manifest's [`LayerManifest::layout`]); the others as the checkpoint holds them.
    pub rewrite: Option<(&'a dyn crate::RecordTransform, &'a str)>,
}

/// Removes its file when dropped, unless it was taken back (`.0 = None`).
struct RemoveOnDrop(Option<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Puts directory `dir`'s entries (renames, removals) on disk.
fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir))
}

/// Writes a packed store of `stacks` from `ckpt` into `out`, then re-reads and verifies every record.
/// Memory stays bounded by one record; the data goes to a temporary file renamed into place at the end.
pub fn convert(
    ckpt: &Checkpoint,
    stacks: &[StackedExperts],
    out: &Path,
    opts: &ConvertOptions,
) -> Result<PackedStore, StoreError> {
    if out.join(MANIFEST_FILE).exists() && !opts.force {
        return Err(bad(out, "already holds a store; pass --force to replace it"));
    }
    // What an interrupted convert leaves behind is ours to replace, not someone else's files: its temporary
    // files, and with --force a data file whose manifest is gone.
    let mut leftovers = vec![format!("{DATA_FILE}.partial"), format!("{MANIFEST_FILE}.partial")];
    if opts.force {
        leftovers.push(DATA_FILE.to_string());
    }
    if out.exists() && !out.join(MANIFEST_FILE).exists() {
        let foreign: Vec<std::ffi::OsString> = (std::fs::read_dir(out).map_err(io_err(out))?)
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .filter(|name| !leftovers.iter().any(|l| name == l.as_str()))
            .collect();
        if !foreign.is_empty() {
            // Only a data file left by an interrupted convert stands in the way: --force takes it.
            let message = if foreign.iter().all(|name| name == DATA_FILE) {
                format!(
                    "holds {DATA_FILE} without its manifest (an interrupted convert?); pass --force to replace \
                     it, or choose a new directory"
                )
            } else {
                "exists and is not empty (and not a store); choose a new directory".to_string()
            };
            return Err(bad(out, message));
        }
    }
    std::fs::create_dir_all(out).map_err(io_err(out))?;
    let model_dir = std::fs::canonicalize(ckpt.dir()).map_err(io_err(ckpt.dir()))?;
    let align = SLOT_ALIGN as u64;
    let mut layers = Vec::new();
    let mut total = 0u64;
    for s in stacks {
        let parts = expected_parts(ckpt, s)?;
        let used = parts.last().map_or(0, |p| p.offset + p.len);
        let places: Vec<(usize, usize)> = parts.iter().map(|p| (p.offset as usize, p.len as usize)).collect();
        // Where the rewrite puts the parts, for the layers it takes.
        let stored = opts.rewrite.and_then(|(t, _)| t.parts(s.layer, &places));
        let stored_end = (stored.iter().flatten())
            .map(|&(off, len)| (off + len) as u64)
            .max()
            .unwrap_or(0);
        let record_len = used.max(stored_end).max(1).div_ceil(align) * align;
        layers.push((s, parts, places, stored, record_len));
        total += record_len * s.num_experts as u64;
    }
    let tmp = out.join(format!("{DATA_FILE}.partial"));
    // A convert that fails before its data is in place takes its partial file with it: after a full disk,
    // nearly the whole store's size.
    let mut partial = RemoveOnDrop(Some(tmp.clone()));
    // Records are whole aligned blocks written from an aligned buffer, so the data file can bypass the page
    // cache: converting a model bigger than memory then holds one record, not gigabytes of dirty pages.
    let (mut file, mut uncached) = crate::platform::create_uncached(&tmp).map_err(io_err(&tmp))?;
    let max_record = layers.iter().map(|(_, _, _, _, len)| *len).max().unwrap_or(align);
    let allocate = || {
        crate::SlotBuf::allocate(1, max_record as usize)
            .and_then(|mut v| v.pop())
            .ok_or_else(|| bad(&tmp, format!("cannot allocate a {max_record}-byte record buffer")))
    };
    let mut buf = allocate()?;
    // A rewritten record is assembled here first, as it would be read, and rewritten from here into `buf`.
    let mut source = match layers.iter().any(|(_, _, _, stored, _)| stored.is_some()) {
        true => Some(allocate()?),
        false => None,
    };
    let mut offset = 0u64;
    let mut manifest_layers = Vec::new();
    for (s, parts, places, stored, record_len) in layers {
        let tensors: Vec<_> = s.tensors.iter().map(|n| ckpt.require(n)).collect::<Result<_, _>>()?;
        let rewrite = opts.rewrite.map(|(t, _)| t).zip(stored.as_ref());
        let mut records = Vec::with_capacity(s.num_experts);
        for e in 0..s.num_experts {
            let assemble_in = match (rewrite, source.as_mut()) {
                (Some(_), Some(src)) => src.as_mut_slice(),
                _ => buf.as_mut_slice(),
            };
            let assembled = &mut assemble_in[..record_len as usize];
            assembled.fill(0);
            for (p, t) in parts.iter().zip(&tensors) {
                let len = p.len as usize;
                let src = &t.bytes()[e * len..(e + 1) * len];
                assembled[p.offset as usize..p.offset as usize + len].copy_from_slice(src);
            }
            let record = &mut buf.as_mut_slice()[..record_len as usize];
            if let (Some((transform, to)), Some(src)) = (rewrite, &source) {
                record.fill(0);
                (transform.apply(s.layer, &src.as_ref()[..record_len as usize], &places, record, to)).map_err(|m| {
                    bad(
                        ckpt.dir(),
                        format!("layer {} expert {e} cannot be rewritten: {m}", s.layer),
                    )
                })?;
            }
            match file.write_all(record) {
                Ok(()) => {}
                // A filesystem that accepts O_DIRECT at open but refuses the write: go on through the cache.
                Err(e) if uncached && e.kind() == std::io::ErrorKind::InvalidInput => {
                    crate::platform::set_cached(&file).map_err(io_err(&tmp))?;
                    uncached = false;
                    use std::io::Seek;
                    file.seek(std::io::SeekFrom::Start(offset)).map_err(io_err(&tmp))?;
                    file.write_all(record).map_err(io_err(&tmp))?;
                }
                Err(e) => return Err(io_err(&tmp)(e)),
            }
            // Through the cache, keep the dirty pages bounded: flush every 256 MiB.
            if !uncached && (offset + record_len) / (256 << 20) != offset / (256 << 20) {
                file.sync_data().map_err(io_err(&tmp))?;
            }
            let record = &buf.as_ref()[..record_len as usize];
            records.push(RecordManifest {
                offset,
                xxh3: format!("{:016x}", xxhash_rust::xxh3::xxh3_64(record)),
            });
            offset += record_len;
            (opts.progress)(offset, total);
        }
        let layout = stored.as_ref().and(opts.rewrite).map(|(_, name)| name.to_string());
        manifest_layers.push(LayerManifest {
            layer: s.layer,
            record_len,
            parts,
            layout,
            stored_parts: stored.map(|to| to.into_iter().map(|(off, len)| (off as u64, len as u64)).collect()),
            records,
            source_sample: Some(source_sample(ckpt, s)?),
        });
    }
    file.sync_all().map_err(io_err(&tmp))?;
    drop(file);
    let data = out.join(DATA_FILE);
    let mpath = out.join(MANIFEST_FILE);
    // A replaced store's manifest goes before its data does: a failure between the two renames must not leave
    // the old manifest over the new data (same length when only the layout changed, so it would open).
    match std::fs::remove_file(&mpath) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io_err(&mpath)(e)),
        Err(_) => {}
        // On disk before the rename too, or a power loss could keep the rename and lose the removal.
        Ok(()) => sync_dir(out)?,
    }
    std::fs::rename(&tmp, &data).map_err(io_err(&data))?;
    // Removed on failure until the manifest lands: a data file without one only blocks the next convert.
    partial.0 = Some(data.clone());
    // The data's rename on disk before the manifest's: else a power loss could keep the manifest over the old
    // data file.
    sync_dir(out)?;
    let manifest = Manifest {
        format: FORMAT.into(),
        // Version 1 where every record is as the checkpoint holds it: builds from before rewritten layouts
        // read those stores, and refuse the others.
        version: match manifest_layers.iter().any(|l| l.layout.is_some()) {
            true => 2,
            false => 1,
        },
        model_dir,
        data_file: DATA_FILE.into(),
        data_len: offset,
        record_align: align,
        checksum: "xxh3-64".into(),
        layers: manifest_layers,
    };
    // Checked and every record re-read before the manifest lands: a store that fails either never opens.
    let unpublished = PackedStore {
        dir: out.to_path_buf(),
        manifest,
        data_modified: None,
    };
    unpublished.check_against(ckpt, stacks)?;
    let bad_records = unpublished.verify(&|_| {})?;
    if let Some(first) = bad_records.first() {
        return Err(bad(&data, format!("verification after writing failed: {first}")));
    }
    let mtmp = out.join(format!("{MANIFEST_FILE}.partial"));
    let text = serde_json::to_string_pretty(&unpublished.manifest).map_err(|e| bad(&mpath, e.to_string()))?;
    let mut mfile = File::create(&mtmp).map_err(io_err(&mtmp))?;
    mfile.write_all(text.as_bytes()).map_err(io_err(&mtmp))?;
    mfile.sync_all().map_err(io_err(&mtmp))?;
    drop(mfile);
    std::fs::rename(&mtmp, &mpath).map_err(io_err(&mpath))?;
    partial.0 = None;
    // The renames themselves last once the directory is on disk too.
    sync_dir(out)?;
    PackedStore::open(out)
}
