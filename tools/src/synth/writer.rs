//! Shards and their bytes: tensors are generated in parallel into a few buffers that a writer thread appends
//! to each shard, bypassing the page cache where the OS allows, so memory stays bounded for any model size.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use anyhow::{Context, Result};
use rayon::prelude::*;
use serde_json::json;

use super::plan::{total_bytes, Fill, Tensor};
use super::write_file;

/// One shard: its file name and the indices of its tensors, in data order.
pub(super) struct Shard {
    pub(super) name: String,
    pub(super) tensors: Vec<usize>,
}

/// Splits the tensors, in order, into shards of at most `limit` bytes (a bigger tensor gets a shard of its
/// own); within a shard they are ordered by decreasing alignment so each starts aligned.
pub(super) fn plan_shards(tensors: &[Tensor], limit: u64) -> Vec<Shard> {
    let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        if size > 0 && size + t.bytes() > limit {
            groups.push(Vec::new());
            size = 0;
        }
        size += t.bytes();
        groups.last_mut().expect("one shard").push(i);
    }
    let n = groups.len();
    groups
        .into_iter()
        .enumerate()
        .map(|(i, mut g)| {
            g.sort_by_key(|&t| std::cmp::Reverse(tensors[t].align()));
            let name = if n == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{n:05}.safetensors", i + 1)
            };
            Shard { name, tensors: g }
        })
        .collect()
}

/// The safetensors header of a shard, padded with spaces so the data starts on a 4 KiB boundary.
pub(super) fn shard_header(tensors: &[Tensor], shard: &Shard) -> Result<Vec<u8>> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "mlx"}));
    let mut off = 0u64;
    for &i in &shard.tensors {
        let t = &tensors[i];
        header.insert(
            t.name.clone(),
            json!({"dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [off, off + t.bytes()]}),
        );
        off += t.bytes();
    }
    let json = serde_json::to_vec(&header)?;
    let len = (8 + json.len()).div_ceil(4096) * 4096 - 8;
    let mut out = Vec::with_capacity(8 + len);
    out.extend_from_slice(&(len as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out.resize(8 + len, b' ');
    Ok(out)
}

/// Size of the buffers handed from the generator to the writer thread.
pub(super) const CHUNK: usize = 16 << 20;
/// Buffers in flight: one being filled, the rest queued or being written.
pub(super) const BUFFERS: usize = 4;
/// Alignment of O_DIRECT writes (offset, length and memory).
pub(super) const DIRECT_ALIGN: usize = 4096;

/// A `CHUNK`-byte buffer whose start is `DIRECT_ALIGN`-aligned in memory.
pub(super) struct Buf {
    pub(super) mem: Vec<u8>,
    pub(super) start: usize,
}

impl Buf {
    pub(super) fn new() -> Self {
        let mem = vec![0u8; CHUNK + DIRECT_ALIGN];
        let start = mem.as_ptr().align_offset(DIRECT_ALIGN);
        // Unaligned memory only costs the O_DIRECT path (the writer then falls back to buffered writes).
        let start = if start < DIRECT_ALIGN { start } else { 0 };
        Buf { mem, start }
    }

    pub(super) fn bytes(&mut self) -> &mut [u8] {
        &mut self.mem[self.start..self.start + CHUNK]
    }
}

/// What the generator sends the writer thread, in file order.
pub(super) enum Msg {
    /// Create this file.
    Open(PathBuf),
    /// Append the first `len` bytes of the buffer (then hand it back).
    Data(Buf, usize),
    /// Fsync the open file.
    Close,
}

/// Writes the shards and `model.safetensors.index.json`: the generator fills buffers in parallel while a
/// writer thread appends full ones to the file, so memory stays at `BUFFERS × CHUNK` for any model size.
pub(super) fn write_shards(
    dir: &Path,
    tensors: &[Tensor],
    shards: &[Shard],
    seed: u64,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<()> {
    let (full_tx, full_rx) = mpsc::sync_channel::<Msg>(BUFFERS);
    let (empty_tx, empty_rx) = mpsc::channel::<Buf>();
    for _ in 0..BUFFERS {
        empty_tx.send(Buf::new()).expect("the receiver is alive");
    }
    std::thread::scope(|scope| {
        let writer = scope.spawn(move || write_loop(full_rx, empty_tx, progress));
        let generated = generate(dir, tensors, shards, seed, &full_tx, &empty_rx);
        drop(full_tx);
        // A writer error explains a generator that stopped because the writer went away.
        writer.join().expect("the writer thread does not panic")?;
        generated
    })?;
    let mut weight_map = serde_json::Map::new();
    for shard in shards {
        for &i in &shard.tensors {
            weight_map.insert(tensors[i].name.clone(), json!(shard.name));
        }
    }
    let index = json!({"metadata": {"total_size": total_bytes(tensors)}, "weight_map": weight_map});
    write_file(
        &dir.join("model.safetensors.index.json"),
        &serde_json::to_string_pretty(&index)?,
    )
}

/// One output file, written around the page cache where the OS allows (O_DIRECT on Linux, F_NOCACHE on macOS:
/// disk speed, and no cached copy to flatter a later cold benchmark). O_DIRECT writes whole blocks, so a tail
/// shorter than a block is written padded and cut off at close.
pub(super) struct OutFile {
    pub(super) path: PathBuf,
    pub(super) file: File,
    pub(super) direct: bool,
    /// Bytes of real content written so far.
    pub(super) len: u64,
}

impl OutFile {
    pub(super) fn create(path: PathBuf) -> Result<Self> {
        let (file, direct) =
            expert_store::platform::create_uncached(&path).with_context(|| format!("creating {}", path.display()))?;
        // Only Linux's O_DIRECT needs whole aligned blocks; macOS's F_NOCACHE writes take any length.
        let direct = direct && expert_store::platform::UNCACHED_WRITES_NEED_ALIGNMENT;
        Ok(OutFile {
            path,
            file,
            direct,
            len: 0,
        })
    }

    pub(super) fn append(&mut self, buf: &[u8], len: usize) -> Result<()> {
        let io = |p: &Path| format!("writing {}", p.display());
        if self.direct {
            let padded = len.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
            match self.file.write_all(&buf[..padded]) {
                Ok(()) => {
                    self.len += len as u64;
                    return Ok(());
                }
                // Some filesystems accept O_DIRECT at open and refuse the write: go on buffered from here.
                Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => self.buffered()?,
                Err(e) => return Err(e).with_context(|| io(&self.path)),
            }
        }
        self.file.write_all(&buf[..len]).with_context(|| io(&self.path))?;
        self.len += len as u64;
        Ok(())
    }

    /// Turns O_DIRECT off and goes back to the end of the real content.
    pub(super) fn buffered(&mut self) -> Result<()> {
        use std::io::{Seek, SeekFrom};
        expert_store::platform::set_cached(&self.file)
            .with_context(|| format!("turning off O_DIRECT on {}", self.path.display()))?;
        self.direct = false;
        self.file
            .seek(SeekFrom::Start(self.len))
            .with_context(|| format!("seeking in {}", self.path.display()))?;
        Ok(())
    }

    /// Cuts off the padding of the last block and fsyncs.
    pub(super) fn close(self) -> Result<()> {
        if self.direct {
            self.file
                .set_len(self.len)
                .with_context(|| format!("truncating {}", self.path.display()))?;
        }
        self.file
            .sync_all()
            .with_context(|| format!("syncing {}", self.path.display()))
    }
}

/// The writer thread: appends what it receives, returns emptied buffers, fsyncs each file at its end.
pub(super) fn write_loop(
    rx: mpsc::Receiver<Msg>,
    back: mpsc::Sender<Buf>,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<()> {
    let mut open: Option<OutFile> = None;
    for msg in rx {
        match msg {
            Msg::Open(path) => open = Some(OutFile::create(path)?),
            Msg::Data(mut buf, len) => {
                let f = open.as_mut().context("data before a file was opened")?;
                f.append(buf.bytes(), len)?;
                progress(len as u64);
                // The generator may already be done and gone; then the buffer is simply dropped.
                let _ = back.send(buf);
            }
            Msg::Close => open.take().context("close before a file was opened")?.close()?,
        }
    }
    Ok(())
}

/// Fills buffers in file order and passes full ones to the writer thread.
pub(super) struct Sink<'a> {
    pub(super) tx: &'a mpsc::SyncSender<Msg>,
    pub(super) empty: &'a mpsc::Receiver<Buf>,
    pub(super) buf: Option<Buf>,
    pub(super) len: usize,
}

impl Sink<'_> {
    pub(super) fn gone() -> anyhow::Error {
        anyhow::anyhow!("the writer thread stopped")
    }

    pub(super) fn send(&self, msg: Msg) -> Result<()> {
        self.tx.send(msg).map_err(|_| Self::gone())
    }

    /// Appends `n` bytes; `fill(dst, offset)` writes bytes `offset..offset + dst.len()` of them into `dst`.
    pub(super) fn put(&mut self, n: u64, fill: impl Fn(&mut [u8], u64)) -> Result<()> {
        let mut done = 0u64;
        while done < n {
            let mut buf = match self.buf.take() {
                Some(b) => b,
                None => self.empty.recv().map_err(|_| Self::gone())?,
            };
            let k = (CHUNK - self.len).min((n - done) as usize);
            fill(&mut buf.bytes()[self.len..self.len + k], done);
            self.len += k;
            done += k as u64;
            if self.len == CHUNK {
                self.send(Msg::Data(buf, CHUNK))?;
                self.len = 0;
            } else {
                self.buf = Some(buf);
            }
        }
        Ok(())
    }

    /// Sends the partly filled buffer, if any.
    pub(super) fn flush(&mut self) -> Result<()> {
        if let Some(buf) = self.buf.take() {
            self.send(Msg::Data(buf, self.len))?;
        }
        self.len = 0;
        Ok(())
    }
}

/// The generator: each shard's header and tensor data in order.
pub(super) fn generate(
    dir: &Path,
    tensors: &[Tensor],
    shards: &[Shard],
    seed: u64,
    tx: &mpsc::SyncSender<Msg>,
    empty: &mpsc::Receiver<Buf>,
) -> Result<()> {
    let mut sink = Sink {
        tx,
        empty,
        buf: None,
        len: 0,
    };
    for shard in shards {
        sink.send(Msg::Open(dir.join(&shard.name)))?;
        let header = shard_header(tensors, shard)?;
        sink.put(header.len() as u64, |dst, off| {
            dst.copy_from_slice(&header[off as usize..off as usize + dst.len()])
        })?;
        for &i in &shard.tensors {
            let t = &tensors[i];
            let key = splitmix(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ splitmix(i as u64));
            sink.put(t.bytes(), |dst, off| fill(dst, t.fill, key, off))?;
        }
        sink.flush()?;
        sink.send(Msg::Close)?;
    }
    Ok(())
}

/// SplitMix64's output function.
pub(super) fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fills `buf` with bytes `start..start + buf.len()` of a tensor filled per `how`. Random bytes are the
/// SplitMix64 stream of `key` (word `k` is `splitmix(key + k·φ)`), so the content does not depend on how the
/// tensor is cut into buffers; big buffers are generated in parallel.
pub(super) fn fill(buf: &mut [u8], how: Fill, key: u64, start: u64) {
    match how {
        Fill::Random => {
            let word = |k: u64| splitmix(key.wrapping_add(k.wrapping_mul(0x9e37_79b9_7f4a_7c15))).to_le_bytes();
            // An unaligned head up to the next 8-byte boundary of the tensor.
            let head = (((8 - start % 8) % 8) as usize).min(buf.len());
            let (first, rest) = buf.split_at_mut(head);
            let skip = (start % 8) as usize;
            first.copy_from_slice(&word(start / 8)[skip..skip + head]);
            let base = (start + head as u64) / 8;
            const BLOCK: usize = 1 << 16;
            rest.par_chunks_mut(BLOCK).enumerate().for_each(|(b, c)| {
                let k0 = base + (b * BLOCK / 8) as u64;
                for (j, w) in c.chunks_mut(8).enumerate() {
                    w.copy_from_slice(&word(k0 + j as u64)[..w.len()]);
                }
            });
        }
        Fill::Bf16(v) => {
            let bits = v.to_bits();
            // Round to nearest even.
            let b = ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
            let [lo, hi] = b.to_le_bytes();
            let pattern = if start.is_multiple_of(2) { [lo, hi] } else { [hi, lo] };
            for w in buf.chunks_mut(2) {
                w.copy_from_slice(&pattern[..w.len()]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_bytes_do_not_depend_on_how_a_tensor_is_cut() {
        let mut whole = vec![0u8; 300_001];
        fill(&mut whole, Fill::Random, 7, 0);
        let mut pieces = vec![0u8; whole.len()];
        let cuts = [0, 3, 8, 13, 70_000, 200_001, whole.len()];
        for w in cuts.windows(2) {
            fill(&mut pieces[w[0]..w[1]], Fill::Random, 7, w[0] as u64);
        }
        assert_eq!(whole, pieces);
        let mut other = vec![0u8; 64];
        fill(&mut other, Fill::Random, 8, 0);
        assert_ne!(&whole[..64], &other[..]);
    }

    #[test]
    fn bf16_fill_rounds() {
        let mut b = [0u8; 4];
        fill(&mut b, Fill::Bf16(1.0), 0, 0);
        assert_eq!(b, [0x80, 0x3f, 0x80, 0x3f]);
    }
}
