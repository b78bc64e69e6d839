//! Arrays as bit patterns. Parity and "is the file what a save would write" are questions about
//! bits, not values: value equality calls -0.0 equal to +0.0 and NaN unequal to itself, so
//! both compare arrays viewed as unsigned integers of their item size instead.

use super::error::Result;
use mlx_rs::{Array, Dtype};

/// `a`'s elements reinterpreted (not converted) as unsigned integers of the same item size.
fn unsigned_view(a: &Array) -> Result<Array> {
    Ok(match a.item_size() {
        1 => a.view::<u8>()?,
        2 => a.view::<u16>()?,
        4 => a.view::<u32>()?,
        _ => a.view::<u64>()?,
    })
}

/// Whether two arrays have one dtype and shape and hold the same bit patterns.
pub fn same_bits(a: &Array, b: &Array) -> Result<bool> {
    if a.dtype() != b.dtype() || a.shape() != b.shape() {
        return Ok(false);
    }
    Ok(unsigned_view(a)?.eq_values(unsigned_view(b)?)?)
}

/// `a`'s bit patterns in row-major order, each widened to `u64`, so that tests can compare
/// (and print) arrays bit for bit whatever their dtype.
pub fn widened_bits(a: &Array) -> Result<Vec<u64>> {
    // Unsigned to wider unsigned conversion zero-extends, so the patterns survive it.
    let wide = unsigned_view(a)?.as_dtype(Dtype::Uint64)?;
    wide.eval()?;
    Ok(wide.as_slice::<u64>().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_bits_tells_signed_zeros_apart_and_matches_nan_with_itself() -> Result<()> {
        let zeros = Array::from_slice(&[0.0f32, 1.5], &[2]);
        let signed = Array::from_slice(&[-0.0f32, 1.5], &[2]);
        assert!(
            zeros.eq_values(&signed)?,
            "value equality calls -0 and +0 equal"
        );
        assert!(!same_bits(&zeros, &signed)?);
        let nan = Array::from_slice(&[f32::NAN, 2.0], &[2]);
        assert!(same_bits(&nan, &nan.clone())?);
        for dtype in [Dtype::Bfloat16, Dtype::Float16] {
            let (a, b) = (zeros.as_dtype(dtype)?, signed.as_dtype(dtype)?);
            assert!(same_bits(&a, &a.clone())?);
            assert!(!same_bits(&a, &b)?);
        }
        Ok(())
    }

    #[test]
    fn same_bits_needs_one_dtype_and_shape() -> Result<()> {
        let a = Array::from_slice(&[1.0f32, 2.0], &[2]);
        assert!(!same_bits(&a, &a.reshape(&[1, 2])?)?);
        // 1.0f32 and 1065353216u32 share a bit pattern but not a dtype.
        assert!(!same_bits(&a, &a.view::<u32>()?)?);
        Ok(())
    }

    #[test]
    fn widened_bits_are_the_raw_patterns_of_each_item_size() -> Result<()> {
        let f = Array::from_slice(&[-0.0f32, 1.0], &[2]);
        assert_eq!(widened_bits(&f)?, vec![0x8000_0000, 0x3f80_0000]);
        assert_eq!(
            widened_bits(&f.as_dtype(Dtype::Bfloat16)?)?,
            vec![0x8000, 0x3f80]
        );
        let bytes = Array::from_slice(&[0u8, 255], &[2]);
        assert_eq!(widened_bits(&bytes)?, vec![0, 255]);
        let long = Array::from_slice(&[-1i64], &[1]);
        assert_eq!(widened_bits(&long)?, vec![u64::MAX]);
        Ok(())
    }
}
