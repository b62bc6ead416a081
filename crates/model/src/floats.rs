//! Floating-point tensors as files store them (TensorFlow checkpoints, safetensors): half,
//! bfloat16, single or double precision, little-endian, read as `f32`.

/// How a file encodes a floating-point tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FloatEncoding {
    F16,
    BF16,
    F32,
    F64,
}

impl FloatEncoding {
    /// `bytes` as `f32` values (a trailing partial value is ignored; doubles beyond the range
    /// of `f32` become infinite, which the restore refuses).
    pub(crate) fn decode(self, bytes: &[u8]) -> Vec<f32> {
        match self {
            Self::F16 => chunks(bytes, |b| half::f16::from_le_bytes(b).to_f32()),
            Self::BF16 => chunks(bytes, |b| half::bf16::from_le_bytes(b).to_f32()),
            Self::F32 => chunks(bytes, f32::from_le_bytes),
            Self::F64 => chunks(bytes, |b: [u8; 8]| f64::from_le_bytes(b) as f32),
        }
    }
}

/// `f` of each `N`-byte chunk of `bytes`.
pub(crate) fn chunks<const N: usize, T>(bytes: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|c| f(c.try_into().expect("chunks_exact gives N bytes")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_encoding_reads_its_values() {
        let values = [1.5f32, -0.25, 65504.0];
        let bytes =
            |f: &dyn Fn(f32) -> Vec<u8>| values.iter().flat_map(|v| f(*v)).collect::<Vec<_>>();
        let f16 = bytes(&|v| half::f16::from_f32(v).to_le_bytes().to_vec());
        let bf16 = bytes(&|v| half::bf16::from_f32(v).to_le_bytes().to_vec());
        let f64s = bytes(&|v| f64::from(v).to_le_bytes().to_vec());
        assert_eq!(FloatEncoding::F16.decode(&f16), values);
        // bfloat16 keeps 8 bits of mantissa: 65504 rounds to 65536
        assert_eq!(FloatEncoding::BF16.decode(&bf16), [1.5, -0.25, 65536.0]);
        assert_eq!(FloatEncoding::F64.decode(&f64s), values);
        assert_eq!(
            FloatEncoding::F64.decode(&1e300f64.to_le_bytes()),
            [f32::INFINITY]
        );
    }
}
