//! The `cpu` backend's matrix kernels: MLX affine-quantized and dense (bf16/f16/f32) weights times f32
//! activations, SIMD with runtime dispatch (AVX-512 / AVX2+FMA / NEON) over a scalar reference.
//!
//! A matmul walks weight rows in parallel (rayon). Each row is unpacked once into f32 codes, then every
//! token's dot product is taken per group: `y = Σ_g scale_g·(q_g·x_g) + bias_g·Σx_g`. Each output element is
//! computed by one thread in a fixed order, so results do not depend on thread count or on how many tokens
//! share the call: a prefill row equals the same token decoded alone, bit for bit.

pub mod kv;
#[cfg(target_arch = "x86_64")]
mod kv_x86;
#[cfg(target_arch = "aarch64")]
mod neon;
pub mod q8;
mod scalar;
pub mod tiled;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::sync::OnceLock;

use half::{bf16, f16};
use rayon::prelude::*;

pub use scalar::reference_matmul;
pub use tiled::TiledMatrix;

/// Float types that weights, scales and biases are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatType {
    /// IEEE single.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
}

impl FloatType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            FloatType::F32 => 4,
            _ => 2,
        }
    }

    /// Element `i` of a little-endian buffer of this type, as f32 (the caller guarantees the bound).
    #[inline(always)]
    pub fn get(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            FloatType::F32 => {
                let b = &bytes[i * 4..i * 4 + 4];
                f32::from_le_bytes([b[0], b[1], b[2], b[3]])
            }
            FloatType::F16 => f16::from_bits(u16::from_le_bytes([bytes[i * 2], bytes[i * 2 + 1]])).to_f32(),
            FloatType::BF16 => bf16::from_bits(u16::from_le_bytes([bytes[i * 2], bytes[i * 2 + 1]])).to_f32(),
        }
    }

    /// Converts `out.len()` elements starting at element `start` to f32.
    pub fn to_f32(self, bytes: &[u8], start: usize, out: &mut [f32]) {
        let src = &bytes[start * self.size()..(start + out.len()) * self.size()];
        match self {
            FloatType::F32 => {
                for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            FloatType::F16 => {
                #[cfg(target_arch = "x86_64")]
                if x86::f16c_available() {
                    return x86::f16_to_f32(src, out);
                }
                for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
            FloatType::BF16 => {
                #[cfg(target_arch = "x86_64")]
                if x86::f16c_available() {
                    return x86::bf16_to_f32(src, out);
                }
                for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
                }
            }
        }
    }
}

/// An MLX affine-quantized matrix `[rows, cols]` viewed in place: codes packed as a little-endian bit stream
/// per row, one scale and one bias per `group` consecutive columns (`w = scale·q + bias`; scales may be
/// negative).
#[derive(Debug, Clone, Copy)]
pub struct QuantMatrix<'a> {
    /// Packed codes, `rows × cols·bits/8` bytes.
    pub packed: &'a [u8],
    /// Scales, `rows × cols/group` elements of `scale_type`.
    pub scales: &'a [u8],
    /// Biases, same shape and type as the scales.
    pub biases: &'a [u8],
    /// Element type of scales and biases.
    pub scale_type: FloatType,
    /// Bits per code: 2, 3, 4, 5, 6 or 8.
    pub bits: u32,
    /// Columns per scale/bias group: 32, 64 or 128.
    pub group: usize,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
}

/// A dense float matrix `[rows, cols]` viewed in place.
#[derive(Debug, Clone, Copy)]
pub struct DenseMatrix<'a> {
    /// Row-major elements.
    pub data: &'a [u8],
    /// Their type.
    pub dtype: FloatType,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
}

/// A weight matrix in any supported storage format.
#[derive(Debug, Clone, Copy)]
pub enum MatRef<'a> {
    /// Unquantized.
    Dense(DenseMatrix<'a>),
    /// MLX affine quantized.
    Quant(QuantMatrix<'a>),
    /// 4-bit affine, repacked into 16-row tiles for the int8 kernels.
    Tiled(TiledMatrix<'a>),
}

/// Instruction sets the kernels can use. Outside this crate the SIMD ones come only from [`Isa::detect`] and
/// [`Isa::available`] (their variants cannot be built there): their kernels run unchecked instructions, so an
/// `Isa` is a proof that this CPU has them.
///
/// ```compile_fail
/// let _ = sluice_runtime::cpu::Isa::Avx512;
/// ```
/// ```
/// use sluice_runtime::cpu::Isa;
/// assert!(Isa::available().contains(&Isa::Scalar) && Isa::available().contains(&Isa::detect()));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Portable scalar code.
    Scalar,
    /// x86-64 AVX2 + FMA (+ F16C, which every AVX2 CPU has).
    #[non_exhaustive]
    Avx2,
    /// x86-64 AVX-512F (unpacking uses AVX2).
    #[non_exhaustive]
    Avx512,
    /// AArch64 NEON.
    #[non_exhaustive]
    Neon,
}

impl Isa {
    /// The best instruction set this CPU supports (overridable with `SLUICE_ISA=scalar|avx2|avx512|neon`).
    pub fn detect() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let all = Isa::available();
            let wanted = std::env::var("SLUICE_ISA").ok().map(|s| s.to_ascii_lowercase());
            if let Some(w) = wanted {
                if let Some(i) = all.iter().find(|i| format!("{i:?}").to_ascii_lowercase() == w) {
                    return *i;
                }
                tracing::warn!("SLUICE_ISA={w} is not available on this CPU; using {:?}", all[0]);
            }
            all[0]
        })
    }

    /// Every instruction set this CPU supports, best first (always ends with `Scalar`).
    pub fn available() -> Vec<Isa> {
        #[allow(unused_mut)]
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 =
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            if avx2 && is_x86_feature_detected!("avx512f") {
                v.push(Isa::Avx512);
            }
            if avx2 {
                v.push(Isa::Avx2);
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            if std::arch::is_aarch64_feature_detected!("neon") {
                v.push(Isa::Neon);
            }
        }
        v.push(Isa::Scalar);
        v
    }

    /// `Σ a[i]·b[i]` over equal-length slices.
    #[inline]
    pub fn dot(self, a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (a, b) = (&a[..n], &b[..n]);
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => x86::dot_avx2(a, b),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => x86::dot_avx512(a, b),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => neon::dot(a, b),
            _ => scalar::dot(a, b),
        }
    }

    /// `gate = silu(gate) · up` elementwise, the same bits on every instruction set (softmax's `exp`).
    #[inline]
    pub fn swiglu(self, gate: &mut [f32], up: &[f32]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => x86::swiglu_avx2(gate, up),
            _ => scalar::swiglu(gate, up),
        }
    }

    /// Softmax of `x` in place, the same bits on every instruction set: one `exp` polynomial (about 1 ulp),
    /// the sum in 16 lanes added in a fixed order, then a division.
    #[inline]
    pub fn softmax(self, x: &mut [f32]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => x86::softmax_avx2(x),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => x86::softmax_avx512(x),
            _ => scalar::softmax(x),
        }
    }

    /// Unpacks `out.len()` codes of `bits` bits from the start of a packed row into f32 values.
    #[inline]
    pub fn unpack(self, bits: u32, packed: &[u8], out: &mut [f32]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 if matches!(bits, 2 | 4 | 8) => x86::unpack_avx2(bits, packed, out),
            _ => scalar::unpack(bits, packed, out),
        }
    }
}

/// Packs `bits`-bit codes into MLX's little-endian bit stream (code `k` at bits `[k·bits, (k+1)·bits)`).
pub fn pack_codes(bits: u32, codes: &[u32]) -> Vec<u8> {
    let mut out = vec![0u8; (codes.len() * bits as usize).div_ceil(8)];
    for (k, &c) in codes.iter().enumerate() {
        for j in 0..bits as usize {
            let pos = k * bits as usize + j;
            out[pos / 8] |= (((c >> j) & 1) as u8) << (pos % 8);
        }
    }
    out
}

/// The instruction set the kernels use on this CPU and which int8 kernels `--kernels q8` gets there.
pub fn kernel_summary() -> String {
    let isa = Isa::detect();
    let int8 = match isa {
        Isa::Avx512 if q8::vnni_available() => {
            "int8 kernels for 4- and 8-bit weights, tiled resident matrices, band kernel for streamed records \
             (AVX-512 VNNI)"
        }
        Isa::Avx2 | Isa::Avx512 => {
            "int8 kernels for 4- and 8-bit weights in groups of 32, 64 or 128: tiled resident 4-bit matrices, \
             row by row for streamed records and 8-bit matrices (no AVX-512 VNNI)"
        }
        _ => "no int8 kernels for this instruction set (AVX2 and AVX-512 only so far): --kernels q8 runs the exact kernels",
    };
    let tiling = if q8::Q8Kernel::for_tiled(isa).is_some() {
        let panels = match panel_tiles() {
            1 => "tiles one after another (four streams)",
            _ => "tiles in panels of four (one stream)",
        };
        let prefetch = if decode_prefetch() {
            ", prefetching in decode too"
        } else {
            ""
        };
        format!("; {panels}{prefetch}")
    } else {
        String::new()
    };
    format!("{}: {int8}{tiling}", format!("{isa:?}").to_ascii_lowercase())
}

/// Whether the tiled 4-bit kernels prefetch the next group in decode (one token) too, as they do for prompts:
/// on Intel cores, where a core's one stream leaves DRAM partly idle (see [`DramProbe::four_streams`]), they do
/// (medium decode +26% with the AVX-512 kernel on the Sapphire Rapids host, +3% with the AVX2 one there); on
/// AMD's Zen 3 and 4 (family 25) it cut one thread's rate from DRAM by a quarter (25–28 → 19–21 GB/s), so they do not;
/// on Zen 5 (family 26) they do again (medium decode 38.6–41.0 → 42.3–55.6 tok/s, alternated, 2026-11-30).
/// `SLUICE_DECODE_PREFETCH=1|0` overrides; results are the same bits either way.
pub fn decode_prefetch() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        let by_default = prefetch_by_default(intel_cpu(), amd_family());
        decode_prefetch_rule(by_default, std::env::var("SLUICE_DECODE_PREFETCH").ok().as_deref())
    })
}

/// AMD's CPU family of Zen 5 (`cpuid`'s displayed family, 0x1A).
const AMD_ZEN5_FAMILY: u32 = 26;

/// [`decode_prefetch`]'s default for a CPU that is Intel's or not, and its family if it is AMD's.
fn prefetch_by_default(intel: bool, amd_family: Option<u32>) -> bool {
    intel || amd_family.is_some_and(|f| f >= AMD_ZEN5_FAMILY)
}

/// This CPU's family (`cpuid` leaf 1, base plus extended) when it is AMD's, for the rule above.
fn amd_family() -> Option<u32> {
    #[cfg(target_arch = "x86_64")]
    return x86::amd_family();
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// Whether this is an Intel x86 CPU (`cpuid` vendor), for the rules above and below.
fn intel_cpu() -> bool {
    #[cfg(target_arch = "x86_64")]
    return x86::intel_cpu();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// [`decode_prefetch`] for a CPU whose default is `by_default` and the override's value, if set.
fn decode_prefetch_rule(by_default: bool, set: Option<&str>) -> bool {
    let parse = |v: &str| match v {
        "1" | "on" | "true" => Some(true),
        "0" | "off" | "false" => Some(false),
        _ => None,
    };
    overridden("SLUICE_DECODE_PREFETCH", "0 or 1", set, by_default, parse)
}

/// `set` (an environment variable `name`'s value, if any) read by `parse`, else `default`: a value `parse`
/// refuses is logged as not `expected` and keeps the default.
fn overridden<T>(name: &str, expected: &str, set: Option<&str>, default: T, parse: impl Fn(&str) -> Option<T>) -> T {
    let Some(v) = set.map(str::trim) else {
        return default;
    };
    parse(v).unwrap_or_else(|| {
        tracing::warn!("{name}={v} is not {expected}; using the CPU's default");
        default
    })
}

/// Tiles per panel of the matrices this process tiles (see [`tiled`]): 1 on Intel cores, where the decode
/// kernel's four tiles read as four streams keep more lines in flight than one (medium decode +18% on the
/// Sapphire Rapids host), 4 elsewhere, where one sequential stream lets AMD's prefetchers run (10–30% more
/// weight bytes per second on the AMD EPYC host). `SLUICE_TILE_PANEL=1|4` overrides; results are the same
/// bits either way.
pub fn panel_tiles() -> u8 {
    static PANEL: OnceLock<u8> = OnceLock::new();
    *PANEL.get_or_init(|| panel_tiles_rule(intel_cpu(), std::env::var("SLUICE_TILE_PANEL").ok().as_deref()))
}

/// [`panel_tiles`] for a CPU that is Intel's or not and the override's value, if set.
fn panel_tiles_rule(intel: bool, set: Option<&str>) -> u8 {
    let default = if intel { 1 } else { tiled::PASS_TILES as u8 };
    let parse = |v: &str| v.parse::<u8>().ok().filter(|&p| tiled::valid_panel(p.into()));
    overridden("SLUICE_TILE_PANEL", "1 or 4", set, default, parse)
}

/// This machine's DRAM read bandwidth in GB/s, two ways: the best of [`DramProbe::one_stream`] and
/// [`DramProbe::four_streams`].
pub fn dram_read_gbps(bytes: usize, time: std::time::Duration) -> f64 {
    dram_read_probe(bytes, time).best()
}

/// Multi-threaded sequential DRAM reads, GB/s, in the two access patterns that are fastest on different hosts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DramProbe {
    /// Every thread reads its share as one sequential stream: the fast pattern on the AMD EPYC (Zen 4) host
    /// (one thread: 29–32 GB/s, against 18–21 on interleaved streams), and the one the tiled decode kernel
    /// follows.
    pub one_stream: f64,
    /// Every thread reads four streams of its share in lockstep: faster on the Sapphire Rapids host, where a
    /// core reading one stream left DRAM partly idle (the prefetchers run only so far ahead of one).
    pub four_streams: f64,
}

impl DramProbe {
    /// The machine's limit: the faster pattern.
    pub fn best(&self) -> f64 {
        self.one_stream.max(self.four_streams)
    }
}

/// Sums a `bytes`-long buffer (much larger than the caches) on every rayon thread, alternating the two
/// patterns of [`DramProbe`] for about `time` (each at least once), best pass of each. Alternating passes
/// see the same moments of a host whose bandwidth moves from one second to the next. The buffer sits on huge
/// pages where the OS gives them, as the weights the kernels stream do (a 4 KiB-paged buffer read ~20% slower
/// than decode streams weights on the AMD EPYC host).
pub fn dram_read_probe(bytes: usize, time: std::time::Duration) -> DramProbe {
    let words = (bytes / 8).max(1);
    let mut huge = expert_store::SlotBuf::allocate(1, words * 8).and_then(|mut v| v.pop());
    let mut plain = Vec::new();
    let buf: &mut [u8] = match &mut huge {
        Some(slot) => &mut slot.as_mut_slice()[..words * 8],
        None => {
            plain.resize(words * 8, 0u8);
            &mut plain
        }
    };
    // Written, not left zeroed: untouched anonymous pages all map the one zero page, which the caches hold.
    for (i, w) in buf.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&(i as u64).to_ne_bytes());
    }
    let buf = &*buf;
    let pass = |four: bool| {
        let t = std::time::Instant::now();
        let s: u64 = buf
            .par_chunks(1 << 19)
            .map(|c| if four { sum_four_streams(c) } else { sum_words(c) })
            .sum();
        std::hint::black_box(s);
        (words * 8) as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    let deadline = std::time::Instant::now() + time;
    let mut p = DramProbe {
        one_stream: 0.0,
        four_streams: 0.0,
    };
    loop {
        p.one_stream = p.one_stream.max(pass(false));
        p.four_streams = p.four_streams.max(pass(true));
        if std::time::Instant::now() >= deadline {
            return p;
        }
    }
}

/// Wrapping sum of `c`'s native-endian 64-bit words (a trailing partial word is skipped).
fn sum_words(c: &[u8]) -> u64 {
    c.chunks_exact(8).fold(0u64, |s, w| {
        s.wrapping_add(u64::from_ne_bytes(w.try_into().unwrap_or_default()))
    })
}

/// Wrapping sum of `c`'s words read as four streams in lockstep (its quarters side by side), then the rest.
fn sum_four_streams(c: &[u8]) -> u64 {
    let q = c.len() / 32 * 8;
    let (head, tail) = c.split_at(3 * q);
    let (a, rest) = head.split_at(q);
    let (b, d) = rest.split_at(q);
    let word = |w: &[u8]| u64::from_ne_bytes(w.try_into().unwrap_or_default());
    let lockstep = (a
        .chunks_exact(8)
        .zip(b.chunks_exact(8))
        .zip(d.chunks_exact(8))
        .zip(tail.chunks_exact(8)))
    .fold(0u64, |s, (((a, b), d), e)| {
        s.wrapping_add(word(a))
            .wrapping_add(word(b))
            .wrapping_add(word(d))
            .wrapping_add(word(e))
    });
    lockstep.wrapping_add(sum_words(&tail[q..]))
}

/// Work below this many weight elements runs on the calling thread (rayon's overhead would dominate).
const PAR_MIN_ELEMS: usize = 1 << 15;

/// Bytes of int8 activations (the default `q8` kernels') one pass of [`matmul_many`] takes: a block of a long prompt's
/// tokens whose activations stay in a core's L2 while every row of the task runs against them. On Zen 4 (1 MiB L2) a
/// resident model prefilled 2,048-token passes ~9% slower whole (4 MB of activations at 2,048 columns) than in blocks
/// of 128 tokens, and 512-token passes alike either way (`docs/performance-log.md`, "Thirty-third session"). The exact
/// kernels' f32 copy of a block is four times as large; they were not tuned for it. The block also bounds each call's
/// scratch (the outputs by weight row, the permuted input) to one block.
const TOKEN_BLOCK_BYTES: usize = 256 << 10;

/// Tokens per pass of [`matmul_many`] for inputs of `cols` columns: [`TOKEN_BLOCK_BYTES`] of them as int8,
/// a multiple of 16 (the kernels take tokens four at a time), at least 16.
pub fn token_block(cols: usize) -> usize {
    (TOKEN_BLOCK_BYTES / cols.max(1) / 16 * 16).max(16)
}

impl MatRef<'_> {
    /// Output features.
    pub fn rows(&self) -> usize {
        match self {
            MatRef::Dense(d) => d.rows,
            MatRef::Quant(q) => q.rows,
            MatRef::Tiled(t) => t.rows,
        }
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        match self {
            MatRef::Dense(d) => d.cols,
            MatRef::Quant(q) => q.cols,
            MatRef::Tiled(t) => t.cols,
        }
    }

    /// Row `r` dequantized to f32 (`out.len() == cols`).
    pub fn row(&self, isa: Isa, r: usize, out: &mut [f32]) {
        match self {
            MatRef::Dense(d) => d.dtype.to_f32(d.data, r * d.cols, out),
            MatRef::Tiled(t) => t.row(r, out),
            MatRef::Quant(q) => {
                let row_bytes = q.cols * q.bits as usize / 8;
                isa.unpack(q.bits, &q.packed[r * row_bytes..(r + 1) * row_bytes], out);
                let gpr = q.cols / q.group;
                for (g, chunk) in out.chunks_mut(q.group).enumerate() {
                    let s = q.scale_type.get(q.scales, r * gpr + g);
                    let b = q.scale_type.get(q.biases, r * gpr + g);
                    for v in chunk {
                        *v = s * *v + b;
                    }
                }
            }
        }
    }

    /// `y[t] = W · x[t]` for `n` tokens: `x` is `[n, cols]`, `y` is `[n, rows]`, both row-major.
    pub fn matmul(&self, isa: Isa, x: &[f32], n: usize, y: &mut [f32]) {
        self.matmul_with(isa, x, n, y, true)
    }

    /// [`MatRef::matmul`], with rows split across threads only when `parallel` (callers that already run
    /// one matrix per thread pass `false`). The result is the same either way.
    pub fn matmul_with(&self, isa: Isa, x: &[f32], n: usize, y: &mut [f32], parallel: bool) {
        matmul_many(isa, &[*self], x, n, &mut [y], parallel);
    }

    /// How this matrix wants its activations prepared on `isa`.
    fn activation_layout(&self, isa: Isa) -> ActivationLayout {
        let q8 = match self {
            MatRef::Quant(q) if q8::q8_activations() && cfg!(target_arch = "x86_64") => {
                q8::Q8Kernel::for_matrix(q, isa)
            }
            MatRef::Tiled(_) if q8::q8_activations() && cfg!(target_arch = "x86_64") => q8::Q8Kernel::for_tiled(isa),
            _ => None,
        };
        ActivationLayout {
            group: match self {
                MatRef::Quant(q) => q.group,
                MatRef::Tiled(t) => t.group,
                MatRef::Dense(d) => d.cols,
            },
            q8,
            fused: if q8.is_some() { None } else { self.fused_kernel(isa) },
        }
    }

    /// One task: rows from `first` (`chunk` holds their `[rows, n]` outputs).
    fn run_rows(&self, ctx: &RowCtx<'_>, first: usize, n: usize, chunk: &mut [f32]) {
        let (cols, group) = (self.cols(), ctx.layout.group);
        #[cfg(target_arch = "x86_64")]
        if let (MatRef::Quant(q), Some(k), Some(acts)) = (self, ctx.layout.q8, ctx.acts) {
            if k.band {
                return band_task(q, acts, ctx, first, n, chunk);
            }
            return q8_task(q, k, acts, ctx, first, n, chunk);
        }
        #[cfg(target_arch = "x86_64")]
        if let (MatRef::Tiled(m), Some(_), Some(acts)) = (self, ctx.layout.q8, ctx.acts) {
            return tiled_task(m, acts, ctx, first, n, chunk);
        }
        #[cfg(target_arch = "x86_64")]
        if let (MatRef::Quant(q), Some((true, 4))) = (self, ctx.layout.fused) {
            return q4_block_task(q, ctx, first, n, chunk);
        }
        // Scratch: the unpacked row, or (fused kernels) the row's scales (padded for 16-wide loads) and biases
        // as f32.
        let scratch = if ctx.layout.fused.is_some() {
            2 * cols / group + 16
        } else {
            cols
        };
        let mut codes = vec![0f32; scratch];
        for (i, out_row) in chunk.chunks_mut(n).enumerate() {
            self.row_dot(ctx, first + i, &mut codes, out_row);
        }
    }

    /// `(avx512, bits)` when a fused in-register kernel covers this matrix on `isa`.
    fn fused_kernel(&self, isa: Isa) -> Option<(bool, u32)> {
        match (self, isa) {
            (MatRef::Quant(q), Isa::Avx2 | Isa::Avx512) if matches!(q.bits, 4 | 8) && q.group % 32 == 0 => {
                Some((isa == Isa::Avx512, q.bits))
            }
            _ => None,
        }
    }

    /// One weight row against every token: `out[t] = W[r] · x[t]`. A token's result never depends on the
    /// other tokens in the call (prefill equals decode bit for bit).
    #[inline]
    fn row_dot(&self, c: &RowCtx<'_>, r: usize, codes: &mut [f32], out: &mut [f32]) {
        let cols = self.cols();
        match self {
            MatRef::Dense(_) | MatRef::Tiled(_) => {
                self.row(c.isa, r, codes);
                for (t, o) in out.iter_mut().enumerate() {
                    *o = c.isa.dot(codes, &c.x[t * cols..(t + 1) * cols]);
                }
            }
            MatRef::Quant(q) => {
                let row_bytes = cols * q.bits as usize / 8;
                let packed = &q.packed[r * row_bytes..(r + 1) * row_bytes];
                let gpr = cols / q.group;
                #[cfg(target_arch = "x86_64")]
                if let Some((avx512, bits)) = c.layout.fused {
                    let (scales, rest) = codes.split_at_mut(gpr);
                    let biases = &mut rest[..gpr];
                    q.scale_type.to_f32(q.scales, r * gpr, scales);
                    q.scale_type.to_f32(q.biases, r * gpr, biases);
                    for (t, o) in out.iter_mut().enumerate() {
                        let args = x86::RowArgs {
                            packed,
                            xp: &c.xp[t * cols..(t + 1) * cols],
                            xsum: &c.xsum[t * gpr..(t + 1) * gpr],
                            scales,
                            biases,
                            group: q.group,
                        };
                        *o = x86::fused_row(avx512, bits, &args);
                    }
                    return;
                }
                c.isa.unpack(q.bits, packed, codes);
                for (t, o) in out.iter_mut().enumerate() {
                    let xt = &c.x[t * cols..(t + 1) * cols];
                    let mut acc = 0f32;
                    for g in 0..gpr {
                        let s = q.scale_type.get(q.scales, r * gpr + g);
                        let b = q.scale_type.get(q.biases, r * gpr + g);
                        let span = g * q.group..(g + 1) * q.group;
                        acc += s * c.isa.dot(&codes[span.clone()], &xt[span]) + b * c.xsum[t * gpr + g];
                    }
                    *o = acc;
                }
            }
        }
    }
}

/// `ys[i] = mats[i] · x` for matrices that share the input `x` (`[n, cols]`; `ys[i]` is `[n, rows_i]`): the
/// activations are prepared (group sums, int8 quantization) once per layout the matrices want, and all their
/// rows run in one parallel pass (split across threads only when `parallel`). Each `ys[i]` is what
/// [`MatRef::matmul`] gives for `mats[i]` alone, bit for bit.
pub fn matmul_many(isa: Isa, mats: &[MatRef<'_>], x: &[f32], n: usize, ys: &mut [&mut [f32]], parallel: bool) {
    assert_eq!(mats.len(), ys.len(), "one output per matrix");
    for (m, y) in mats.iter().zip(ys.iter()) {
        assert_eq!(x.len(), n * m.cols(), "matmul input shape");
        assert_eq!(y.len(), n * m.rows(), "matmul output shape");
    }
    if n == 0 || mats.iter().all(|m| m.rows() == 0) {
        return;
    }
    // A long prompt's tokens in blocks (a token's result does not depend on its batch).
    let cols = x.len() / n;
    let block = token_block(cols);
    if n > block {
        for t0 in (0..n).step_by(block) {
            let m = block.min(n - t0);
            let mut parts: Vec<&mut [f32]> = mats
                .iter()
                .zip(ys.iter_mut())
                .map(|(mat, y)| &mut y[t0 * mat.rows()..(t0 + m) * mat.rows()])
                .collect();
            matmul_many(isa, mats, &x[t0 * cols..(t0 + m) * cols], m, &mut parts, parallel);
        }
        return;
    }
    // Activations, prepared once per distinct layout.
    let layouts: Vec<ActivationLayout> = mats.iter().map(|m| m.activation_layout(isa)).collect();
    let mut prepared: Vec<(ActivationLayout, PreparedActs)> = Vec::new();
    let which: Vec<usize> = layouts
        .iter()
        .map(|l| {
            prepared.iter().position(|(p, _)| p == l).unwrap_or_else(|| {
                prepared.push((*l, PreparedActs::new(l, x, n)));
                prepared.len() - 1
            })
        })
        .collect();
    // Results are produced row-major by weight row ([rows, n]) so that tasks write disjoint chunks.
    let mut transposed: Vec<Vec<f32>> = if n == 1 {
        Vec::new()
    } else {
        mats.iter().map(|m| vec![0f32; m.rows() * n]).collect()
    };
    let outs: Vec<&mut [f32]> = if n == 1 {
        ys.iter_mut().map(|y| &mut **y).collect()
    } else {
        transposed.iter_mut().map(|v| v.as_mut_slice()).collect()
    };
    // Tasks of about equal work, ~4 per thread: few enough that each is worth its scheduling, enough that
    // matrices of unequal sizes still share the threads evenly.
    let total: usize = mats.iter().map(|m| m.rows() * m.cols()).sum();
    let parallel = parallel && total >= PAR_MIN_ELEMS;
    let target = if parallel { 4 * rayon::current_num_threads() } else { 1 };
    let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
    for (i, (m, out)) in mats.iter().zip(outs).enumerate() {
        let pieces = (m.rows() * m.cols() * target)
            .div_ceil(total.max(1))
            .clamp(1, m.rows().max(1));
        // A tiled matrix splits at whole passes of four tiles (each task's tiles then lie as a matrix of its
        // rows would, in either panel width), one read in bands at whole bands.
        let align = match (m, layouts[i].q8) {
            (MatRef::Tiled(_), _) => tiled::PASS_ROWS,
            (_, Some(k)) if k.band => tiled::TILE_ROWS,
            _ => 1,
        };
        let rows_per_task = m.rows().div_ceil(pieces).next_multiple_of(align).max(1);
        for (j, chunk) in out.chunks_mut(rows_per_task * n).enumerate() {
            tasks.push((i, j * rows_per_task, chunk));
        }
    }
    let ctxs: Vec<RowCtx<'_>> = which
        .iter()
        .map(|&w| {
            let (layout, p) = &prepared[w];
            RowCtx {
                isa,
                layout: *layout,
                x,
                xp: p.permuted.as_deref().unwrap_or(x),
                xsum: &p.xsum,
                acts: p.quantized.as_ref(),
            }
        })
        .collect();
    let run = |(i, first, chunk): (usize, usize, &mut [f32])| mats[i].run_rows(&ctxs[i], first, n, chunk);
    if parallel && tasks.len() > 1 {
        crate::threads::parallel_each(tasks, run);
    } else {
        tasks.into_iter().for_each(run);
    }
    for (y, yt) in ys.iter_mut().zip(&transposed) {
        untranspose(yt, n, y, parallel);
    }
}

/// `y` (`[n, rows]`) from `yt` (`[rows, n]`), split across threads by tokens when `parallel`. Blocked, so each
/// cache line read from `yt` serves 16 tokens: a row-by-row loop on one thread took ~9% of a long prompt's CPU
/// time (perf, `large` 2k prefill) while the other thread waited.
fn untranspose(yt: &[f32], n: usize, y: &mut [f32], parallel: bool) {
    const TOKENS: usize = 16;
    const ROWS: usize = 64;
    let rows = yt.len() / n;
    if rows == 0 {
        return;
    }
    let fill = |(c, chunk): (usize, &mut [f32])| {
        for r0 in (0..rows).step_by(ROWS) {
            let r1 = (r0 + ROWS).min(rows);
            for (dt, dst) in chunk.chunks_exact_mut(rows).enumerate() {
                let t = c * TOKENS + dt;
                for (d, r) in dst[r0..r1].iter_mut().zip(r0..r1) {
                    *d = yt[r * n + t];
                }
            }
        }
    };
    let chunks: Vec<(usize, &mut [f32])> = y.chunks_mut(TOKENS * rows).enumerate().collect();
    if parallel && chunks.len() > 1 {
        crate::threads::parallel_each(chunks, fill);
    } else {
        chunks.into_iter().for_each(fill);
    }
}

/// How a matrix wants its activations: group sums for the bias term, and int8 quantization or a reordering for
/// its kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ActivationLayout {
    /// Columns per bias group (a dense matrix's whole row).
    group: usize,
    /// The int8 kernel serving the matrix, if any.
    q8: Option<q8::Q8Kernel>,
    /// `(avx512, bits)` of the fused float kernel serving it, if any.
    fused: Option<(bool, u32)>,
}

/// Activations prepared for one [`ActivationLayout`].
struct PreparedActs {
    /// Per-token group sums of `x`.
    xsum: Vec<f32>,
    /// `x` in the fused 4-bit kernel's lane order, when it wants that.
    permuted: Option<Vec<f32>>,
    /// `x` quantized for the int8 kernel, when one serves the matrix.
    quantized: Option<q8::QuantActs>,
}

impl PreparedActs {
    fn new(l: &ActivationLayout, x: &[f32], n: usize) -> Self {
        let cols = x.len() / n;
        #[cfg(target_arch = "x86_64")]
        let permuted = match l.fused {
            Some((avx512, 4)) => {
                let mut v = vec![0f32; x.len()];
                x86::permute_for_q4(x86::q4_chunk(avx512), x, &mut v);
                Some(v)
            }
            _ => None,
        };
        #[cfg(not(target_arch = "x86_64"))]
        let permuted = None;
        Self {
            xsum: group_sums(x, l.group),
            permuted,
            quantized: l.q8.map(|k| q8::quantize(x, n, cols, k)),
        }
    }
}

/// The sum of each `group` consecutive values of `x` (`group` divides `x.len()`), added in eight interleaved
/// partial sums then combined in a fixed order: vectorizable, and the same bits wherever a group sits.
pub fn group_sums(x: &[f32], group: usize) -> Vec<f32> {
    x.chunks(group)
        .map(|g| {
            let mut lanes = [0f32; 8];
            let mut whole = g.chunks_exact(8);
            for c in &mut whole {
                for (l, v) in lanes.iter_mut().zip(c) {
                    *l += v;
                }
            }
            let head =
                ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
            whole.remainder().iter().fold(head, |a, v| a + v)
        })
        .collect()
}

/// A task's rows of a tiled matrix (from `first`, a multiple of four tiles' height) with the int8 kernel.
#[cfg(target_arch = "x86_64")]
fn tiled_task(m: &TiledMatrix<'_>, acts: &q8::QuantActs, c: &RowCtx<'_>, first: usize, n: usize, chunk: &mut [f32]) {
    let rows = chunk.len() / n;
    assert!(first.is_multiple_of(tiled::PASS_ROWS), "a task starts at a pass");
    let (blocks, groups) = (m.cols / 32, m.cols / m.group);
    // The task's first tile; from there its tiles lie as those of a matrix of `rows` rows would.
    let gb = tiled::group_bytes(m.group, m.scale_type);
    let at = tiled::tile_group_at(
        m.rows.div_ceil(tiled::TILE_ROWS),
        groups,
        gb,
        m.panel,
        first / tiled::TILE_ROWS,
        0,
    )
    .0;
    let data = &m.data[at..];
    let mut t = 0;
    while t < n {
        let tokens = if n - t >= 4 { 4 } else { 1 };
        let args = x86::TiledArgs {
            avx512: c.layout.q8.is_some_and(|k| k.avx512),
            data,
            ty: m.scale_type,
            group: m.group,
            rows,
            cols: m.cols,
            panel: m.panel,
            tokens,
            xq: &acts.xq[t * m.cols..(t + tokens) * m.cols],
            block_d: &acts.lane_d[t * blocks..(t + tokens) * blocks],
            xsum: &c.xsum[t * groups..(t + tokens) * groups],
        };
        x86::q4_tiled_rows(&args, &mut chunk[t..], n);
        t += tokens;
    }
}

/// The row-major 4-bit kernel with the tiled kernel's arithmetic over one task's rows (whole 16-row bands).
#[cfg(target_arch = "x86_64")]
fn band_task(q: &QuantMatrix<'_>, acts: &q8::QuantActs, c: &RowCtx<'_>, first: usize, n: usize, chunk: &mut [f32]) {
    let rows = chunk.len() / n;
    assert!(first.is_multiple_of(tiled::TILE_ROWS), "a task starts at a band");
    let (blocks, groups) = (q.cols / 32, q.cols / q.group);
    let (row_bytes, params) = (q.cols / 2, groups * q.scale_type.size());
    let mut t = 0;
    while t < n {
        let tokens = if n - t >= 4 { 4 } else { 1 };
        let args = x86::BandArgs {
            packed: &q.packed[first * row_bytes..(first + rows) * row_bytes],
            scales: &q.scales[first * params..(first + rows) * params],
            biases: &q.biases[first * params..(first + rows) * params],
            ty: q.scale_type,
            group: q.group,
            rows,
            cols: q.cols,
            tokens,
            xq: &acts.xq[t * q.cols..(t + tokens) * q.cols],
            block_d: &acts.lane_d[t * blocks..(t + tokens) * blocks],
            xsum: &c.xsum[t * groups..(t + tokens) * groups],
        };
        x86::q4_band_rows(&args, &mut chunk[t..], n);
        t += tokens;
    }
}

/// The fused AVX-512 4-bit kernel over one task's rows, several rows and tokens per pass.
#[cfg(target_arch = "x86_64")]
fn q4_block_task(q: &QuantMatrix<'_>, c: &RowCtx<'_>, first: usize, n: usize, chunk: &mut [f32]) {
    let gpr = q.cols / q.group;
    let rows = chunk.len() / n;
    let row_bytes = q.cols / 2;
    let mut sb = vec![0f32; rows * 2 * gpr];
    for (i, row) in sb.chunks_mut(2 * gpr).enumerate() {
        let (s, b) = row.split_at_mut(gpr);
        q.scale_type.to_f32(q.scales, (first + i) * gpr, s);
        q.scale_type.to_f32(q.biases, (first + i) * gpr, b);
    }
    let block = x86::Q4Block {
        packed: &q.packed[first * row_bytes..(first + rows) * row_bytes],
        row_bytes,
        sb: &sb,
        xp: c.xp,
        xsum: c.xsum,
        group: q.group,
    };
    x86::fused_q4_block_avx512(&block, rows, n, chunk);
}

/// A task's rows (from `first`, `chunk` holds `[rows, n]` outputs) with the int8-activation kernel: all rows
/// for four tokens per pass while four remain, then one at a time.
#[cfg(target_arch = "x86_64")]
fn q8_task(
    q: &QuantMatrix<'_>,
    k: q8::Q8Kernel,
    acts: &q8::QuantActs,
    c: &RowCtx<'_>,
    first: usize,
    n: usize,
    chunk: &mut [f32],
) {
    let (cols, gpr) = (q.cols, q.cols / q.group);
    let rows = chunk.len() / n;
    let row_bytes = cols * q.bits as usize / 8;
    let size = q.scale_type.size();
    let raw = x86::RawScales {
        scales: &q.scales[first * gpr * size..(first + rows) * gpr * size],
        biases: &q.biases[first * gpr * size..(first + rows) * gpr * size],
        ty: q.scale_type,
        size,
    };
    let lanes = cols / k.lane_cols();
    // Four tokens per pass where the kernel takes them (prefill): each row's codes are read once for all four.
    let mut t = 0;
    while t < n {
        let tokens = if n - t >= 4 { 4 } else { 1 };
        let args = x86::Q8RowsArgs {
            packed: &q.packed[first * row_bytes..(first + rows) * row_bytes],
            row_bytes,
            rows,
            tokens,
            cols,
            xq: &acts.xq[t * cols..(t + tokens) * cols],
            lane_d: &acts.lane_d[t * lanes..(t + tokens) * lanes],
            xsum: &c.xsum[t * gpr..(t + tokens) * gpr],
            group: q.group,
        };
        x86::q8_rows(k, &args, &raw, &mut chunk[t..], n);
        t += tokens;
    }
}

/// Per-call state shared by every row of a matmul.
// Only x86-64 has fused and int8 kernels so far; elsewhere those fields are unused.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct RowCtx<'a> {
    isa: Isa,
    layout: ActivationLayout,
    x: &'a [f32],
    /// `x` in the fused kernel's lane order (`x` itself when no reordering is needed).
    xp: &'a [f32],
    xsum: &'a [f32],
    /// Int8-quantized activations, when `--kernels q8` covers this matrix.
    acts: Option<&'a q8::QuantActs>,
}

#[cfg(test)]
mod tests;
#[cfg(test)]
pub(crate) mod testutil;
