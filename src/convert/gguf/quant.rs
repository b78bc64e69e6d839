//! ggml tensor encodings and mlxb's own decoders for them.
//!
//! Every block-quantized type decodes to *affine groups*: per group a scale `s`, a bias `b` and
//! unsigned codes `q`, with `w = s * q + b` (asymmetric types) or `w = s * (q - zero)` (symmetric
//! types, `b = -zero * s`). The dense values are computed with exactly the float operations of
//! the `gguf` Python package's reference dequantizer, so they are bit-identical to it; the groups
//! of 32 map losslessly onto MLX affine quantization (`--keep-quant`).

use rayon::prelude::*;

/// A ggml element encoding (`ggml_type`), with the ids of the GGUF format.
#[allow(non_camel_case_types, missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

/// (type, id, name, elements per block, bytes per block).
const TYPES: &[(GgmlType, u32, &str, u64, u64)] = &[
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q8_1, 9, "Q8_1", 32, 40),
    (GgmlType::Q2_K, 10, "Q2_K", 256, 84),
    (GgmlType::Q3_K, 11, "Q3_K", 256, 110),
    (GgmlType::Q4_K, 12, "Q4_K", 256, 144),
    (GgmlType::Q5_K, 13, "Q5_K", 256, 176),
    (GgmlType::Q6_K, 14, "Q6_K", 256, 210),
    (GgmlType::Q8_K, 15, "Q8_K", 256, 292),
    (GgmlType::IQ2_XXS, 16, "IQ2_XXS", 256, 66),
    (GgmlType::IQ2_XS, 17, "IQ2_XS", 256, 74),
    (GgmlType::IQ3_XXS, 18, "IQ3_XXS", 256, 98),
    (GgmlType::IQ1_S, 19, "IQ1_S", 256, 50),
    (GgmlType::IQ4_NL, 20, "IQ4_NL", 32, 18),
    (GgmlType::IQ3_S, 21, "IQ3_S", 256, 110),
    (GgmlType::IQ2_S, 22, "IQ2_S", 256, 82),
    (GgmlType::IQ4_XS, 23, "IQ4_XS", 256, 136),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::IQ1_M, 29, "IQ1_M", 256, 56),
    (GgmlType::BF16, 30, "BF16", 1, 2),
    (GgmlType::TQ1_0, 34, "TQ1_0", 256, 54),
    (GgmlType::TQ2_0, 35, "TQ2_0", 256, 66),
    (GgmlType::MXFP4, 39, "MXFP4", 32, 17),
];

/// The types mlxb decodes.
pub const SUPPORTED: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

impl GgmlType {
    fn row(self) -> &'static (GgmlType, u32, &'static str, u64, u64) {
        // TYPES lists every variant, so the search always succeeds.
        TYPES.iter().find(|r| r.0 == self).unwrap_or(&TYPES[0])
    }

    /// The type with GGUF id `id`, if ggml defines one.
    pub fn from_id(id: u32) -> Option<Self> {
        TYPES.iter().find(|r| r.1 == id).map(|r| r.0)
    }

    /// The type named `name` (`"Q4_K"`), if any.
    pub fn from_name(name: &str) -> Option<Self> {
        TYPES
            .iter()
            .find(|r| r.2.eq_ignore_ascii_case(name))
            .map(|r| r.0)
    }

    /// The GGUF id.
    pub fn id(self) -> u32 {
        self.row().1
    }

    /// llama.cpp's name for the type.
    pub fn name(self) -> &'static str {
        self.row().2
    }

    /// (elements per block, bytes per block).
    pub fn block(self) -> (u64, u64) {
        let r = self.row();
        (r.3, r.4)
    }

    /// Whether mlxb can decode this type.
    pub fn is_supported(self) -> bool {
        SUPPORTED.contains(&self)
    }

    /// Whether MLX's own GGUF reader decodes this type exactly (its other types go through f16).
    pub fn mlx_reads(self) -> bool {
        matches!(
            self,
            GgmlType::F32 | GgmlType::F16 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0
        )
    }
}

/// Block-quantized values as affine groups: `w[i] = scales[g] * q[i] + biases[g]`,
/// `g = i / group`; for symmetric types (`zero > 0`) `biases[g] = -zero * scales[g]`.
#[derive(Debug, Clone)]
pub struct Affine {
    /// Elements per group (16 or 32).
    pub group: usize,
    /// Bits per code.
    pub bits: u32,
    /// The unsigned code of each element.
    pub q: Vec<u8>,
    /// One scale per group.
    pub scales: Vec<f32>,
    /// One bias per group.
    pub biases: Vec<f32>,
    /// The code that means 0 for symmetric types, else 0.
    pub zero: u8,
}

impl Affine {
    /// The dense values, with the float operations of the `gguf` reference dequantizer.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.q.len()];
        out.par_chunks_mut(self.group)
            .zip(self.q.par_chunks(self.group))
            .enumerate()
            .for_each(|(g, (o, q))| {
                let (s, b) = (self.scales[g], self.biases[g]);
                if self.zero > 0 {
                    let z = self.zero as i32;
                    o.iter_mut()
                        .zip(q)
                        .for_each(|(o, &q)| *o = s * (q as i32 - z) as f32);
                } else {
                    o.iter_mut()
                        .zip(q)
                        .for_each(|(o, &q)| *o = s * q as f32 + b);
                }
            });
        out
    }

    /// Packs the codes as MLX does (a little-endian bit stream of `bits`-bit codes in `u32`
    /// words, one row after another); `row_len` must be a multiple of 32.
    pub fn pack(&self) -> Vec<u32> {
        let bits = self.bits as usize;
        let mut out = vec![0u32; self.q.len() * bits / 32];
        // 32 codes fill exactly `bits` words, so chunks of 32 never straddle words.
        out.par_chunks_mut(bits)
            .zip(self.q.par_chunks(32))
            .for_each(|(words, codes)| {
                let mut acc: u64 = 0;
                let mut filled = 0usize;
                let mut w = 0usize;
                for &c in codes {
                    acc |= (c as u64) << filled;
                    filled += bits;
                    if filled >= 32 {
                        words[w] = acc as u32;
                        w += 1;
                        acc >>= 32;
                        filled -= 32;
                    }
                }
            });
        out
    }
}

/// What a tensor decodes to.
#[derive(Debug, Clone)]
pub enum Decoded {
    /// Plain floats (from F32/F16/BF16).
    Dense(Vec<f32>),
    /// Block-quantized values.
    Affine(Affine),
}

impl Decoded {
    /// The dense values.
    pub fn into_dense(self) -> Vec<f32> {
        match self {
            Decoded::Dense(v) => v,
            Decoded::Affine(a) => a.dequantize(),
        }
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// One block decoder: block bytes → codes, and per-group scales and biases.
type BlockFn = fn(&[u8], &mut [u8], &mut [f32], &mut [f32]);

/// Layout of one block-quantized type.
struct Layout {
    group: usize,
    bits: u32,
    zero: u8,
    f: BlockFn,
}

fn layout(ty: GgmlType) -> Option<Layout> {
    let l = |group, bits, zero, f: BlockFn| {
        Some(Layout {
            group,
            bits,
            zero,
            f,
        })
    };
    match ty {
        GgmlType::Q4_0 => l(32, 4, 8, q4_0),
        GgmlType::Q4_1 => l(32, 4, 0, q4_1),
        GgmlType::Q5_0 => l(32, 5, 16, q5_0),
        GgmlType::Q5_1 => l(32, 5, 0, q5_1),
        GgmlType::Q8_0 => l(32, 8, 128, q8_0),
        GgmlType::Q2_K => l(16, 2, 0, q2_k),
        GgmlType::Q3_K => l(16, 3, 4, q3_k),
        GgmlType::Q4_K => l(32, 4, 0, q4_k),
        GgmlType::Q5_K => l(32, 5, 0, q5_k),
        GgmlType::Q6_K => l(16, 6, 32, q6_k),
        _ => None,
    }
}

/// Decodes `n` elements of type `ty` from `bytes`; `Err` names the unsupported type.
pub fn decode(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Decoded, String> {
    let (block, block_bytes) = ty.block();
    let (block, block_bytes) = (block as usize, block_bytes as usize);
    if !n.is_multiple_of(block) || bytes.len() != n / block * block_bytes {
        return Err(format!(
            "{} data of {} bytes does not hold {n} elements",
            ty.name(),
            bytes.len()
        ));
    }
    let dense =
        |w: usize, f: fn(&[u8]) -> f32| Ok(Decoded::Dense(bytes.par_chunks(w).map(f).collect()));
    match ty {
        GgmlType::F32 => return dense(4, |c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        GgmlType::F16 => return dense(2, |c| f16_at(c, 0)),
        GgmlType::BF16 => return dense(2, |c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        _ => {}
    }
    let Some(lay) = layout(ty) else {
        return Err(format!("type {} is not supported", ty.name()));
    };
    let groups = block / lay.group;
    let mut q = vec![0u8; n];
    let mut scales = vec![0f32; n / lay.group];
    let mut biases = vec![0f32; n / lay.group];
    bytes
        .par_chunks(block_bytes)
        .zip(q.par_chunks_mut(block))
        .zip(
            scales
                .par_chunks_mut(groups)
                .zip(biases.par_chunks_mut(groups)),
        )
        .for_each(|((b, q), (s, m))| (lay.f)(b, q, s, m));
    Ok(Decoded::Affine(Affine {
        group: lay.group,
        bits: lay.bits,
        q,
        scales,
        biases,
        zero: lay.zero,
    }))
}

/// Low nibbles are elements 0..16, high nibbles 16..32 (Q4_0/Q4_1/Q5_0/Q5_1).
fn nibbles(qs: &[u8], q: &mut [u8]) {
    for j in 0..16 {
        q[j] = qs[j] & 0x0F;
        q[j + 16] = qs[j] >> 4;
    }
}

/// Adds bit j of the little-endian `qh` word as bit 4 of element j.
fn high_bits32(qh: &[u8], q: &mut [u8]) {
    let h = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    for (j, v) in q.iter_mut().enumerate().take(32) {
        *v |= (((h >> j) & 1) as u8) << 4;
    }
}

fn symmetric(d: f32, zero: f32, s: &mut [f32], m: &mut [f32]) {
    s[0] = d;
    m[0] = -zero * d;
}

fn q4_0(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    nibbles(&b[2..18], q);
    symmetric(f16_at(b, 0), 8.0, s, m);
}

fn q4_1(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    nibbles(&b[4..20], q);
    s[0] = f16_at(b, 0);
    m[0] = f16_at(b, 2);
}

fn q5_0(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    nibbles(&b[6..22], q);
    high_bits32(&b[2..6], q);
    symmetric(f16_at(b, 0), 16.0, s, m);
}

fn q5_1(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    nibbles(&b[8..24], q);
    high_bits32(&b[4..8], q);
    s[0] = f16_at(b, 0);
    m[0] = f16_at(b, 2);
}

fn q8_0(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    for (v, &x) in q.iter_mut().zip(&b[2..34]) {
        *v = x ^ 0x80; // int8 x → x + 128
    }
    symmetric(f16_at(b, 0), 128.0, s, m);
}

/// Unpacks `width`-bit fields: element `a*span*k + s*span + l` (k = 8/width fields per byte) is
/// field `s` of byte `a*span + l`, as ggml lays out its K-quant codes.
fn fields(src: &[u8], span: usize, width: u32, q: &mut [u8]) {
    let per_byte = 8 / width as usize;
    let mask = ((1u16 << width) - 1) as u8;
    for (e, v) in q.iter_mut().enumerate() {
        let (a, rest) = (e / (span * per_byte), e % (span * per_byte));
        let (sh, l) = (rest / span, rest % span);
        *v = (src[a * span + l] >> (sh as u32 * width)) & mask;
    }
}

/// The 6-bit scales and mins of Q4_K/Q5_K.
fn scale_min_k4(sc: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut scale, mut min) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        scale[j] = sc[j] & 0x3F;
        min[j] = sc[j + 4] & 0x3F;
        scale[j + 4] = (sc[j + 8] & 0x0F) | ((sc[j] >> 2) & 0x30);
        min[j + 4] = (sc[j + 8] >> 4) | ((sc[j + 4] >> 2) & 0x30);
    }
    (scale, min)
}

fn k_asymmetric(d: f32, dmin: f32, sc: &[u8], s: &mut [f32], m: &mut [f32]) {
    let (scale, min) = scale_min_k4(sc);
    for g in 0..8 {
        s[g] = d * scale[g] as f32;
        m[g] = -(dmin * min[g] as f32);
    }
}

fn q4_k(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    fields(&b[16..144], 32, 4, q);
    k_asymmetric(f16_at(b, 0), f16_at(b, 2), &b[4..16], s, m);
}

fn q5_k(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    fields(&b[48..176], 32, 4, q);
    let mut hi = [0u8; 256];
    fields(&b[16..48], 32, 1, &mut hi);
    q.iter_mut().zip(hi).for_each(|(v, h)| *v |= h << 4);
    k_asymmetric(f16_at(b, 0), f16_at(b, 2), &b[4..16], s, m);
}

fn q6_k(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    fields(&b[0..128], 64, 4, q);
    let mut hi = [0u8; 256];
    fields(&b[128..192], 32, 2, &mut hi);
    q.iter_mut().zip(hi).for_each(|(v, h)| *v |= h << 4);
    let d = f16_at(b, 208);
    for g in 0..16 {
        symmetric(
            d * (b[192 + g] as i8) as f32,
            32.0,
            &mut s[g..],
            &mut m[g..],
        );
    }
}

fn q2_k(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    fields(&b[16..80], 32, 2, q);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for g in 0..16 {
        s[g] = d * (b[g] & 0x0F) as f32;
        m[g] = -(dmin * (b[g] >> 4) as f32);
    }
}

fn q3_k(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    fields(&b[32..96], 32, 2, q);
    let mut hi = [0u8; 256];
    fields(&b[0..32], 32, 1, &mut hi);
    // A set mask bit means "no offset": code = low + 4*bit, value = code - 4.
    q.iter_mut().zip(hi).for_each(|(v, h)| *v |= h << 2);
    let sc = &b[96..108];
    let d = f16_at(b, 108);
    for g in 0..16 {
        let low = (sc[g % 8] >> (4 * (g / 8))) & 0x0F;
        let high = (sc[8 + g % 4] >> (2 * (g / 4))) & 0x03;
        let scale = ((low | (high << 4)) as i8 - 32) as f32;
        symmetric(d * scale, 4.0, &mut s[g..], &mut m[g..]);
    }
}
