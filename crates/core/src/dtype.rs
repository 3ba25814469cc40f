//! Element types.

use std::fmt;

use half::{bf16, f16};

/// The element type of a [`Tensor`](crate::Tensor).
///
/// Quantized payloads get their own dtypes so that a buffer says what its bytes mean.
/// [`DType::F4E2M1x2`] is a *packed* type: one element is one byte holding two E2M1
/// values, element `2j` in the low nibble and `2j + 1` in the high nibble, so a tensor
/// of `n` FP4 values along its last dimension has `n / 2` elements there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// bfloat16 (8 exponent bits, 7 mantissa bits).
    BF16,
    /// IEEE binary16.
    F16,
    /// FP8 E4M3 (`float8_e4m3fn`: no infinities, NaN = `s.1111.111`).
    F8E4M3,
    /// FP8 E5M2 (`float8_e5m2`, IEEE-like with infinities).
    F8E5M2,
    /// E8M0 power-of-two scale (`float8_e8m0fnu`, unsigned, `0xFF` = NaN).
    E8M0,
    /// Two FP4 E2M1 values packed in one byte (low nibble first).
    F4E2M1x2,
    /// Unsigned byte.
    U8,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 64-bit integer.
    U64,
    /// Signed 64-bit integer.
    I64,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 12] = [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::E8M0,
        DType::F4E2M1x2,
        DType::U8,
        DType::U32,
        DType::I32,
        DType::U64,
        DType::I64,
    ];

    /// Bytes per element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::F8E4M3 | DType::F8E5M2 | DType::E8M0 | DType::F4E2M1x2 | DType::U8 => 1,
            DType::U64 | DType::I64 => 8,
        }
    }

    /// Logical values stored per element: 2 for [`DType::F4E2M1x2`], 1 otherwise.
    pub const fn values_per_element(self) -> usize {
        match self {
            DType::F4E2M1x2 => 2,
            _ => 1,
        }
    }

    /// `true` for the types a training stack computes in: f32, bf16 and f16.
    pub const fn is_high_precision_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F16)
    }

    /// The lower-case name used in messages and on the command line.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
            DType::E8M0 => "e8m0",
            DType::F4E2M1x2 => "f4e2m1x2",
            DType::U8 => "u8",
            DType::U32 => "u32",
            DType::I32 => "i32",
            DType::U64 => "u64",
            DType::I64 => "i64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = crate::Error;

    fn from_str(s: &str) -> crate::Result<Self> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| {
                crate::Error::invalid(
                    "DType::from_str",
                    format!(
                        "unknown dtype `{s}`; expected one of {}",
                        DType::ALL.map(DType::name).join(", ")
                    ),
                )
            })
    }
}

/// A Rust type that is the host representation of one [`DType`].
///
/// Implemented for `f32`, `bf16`, `f16`, `u8`, `u32`, `i32`, `u64` and `i64`. The FP8,
/// E8M0 and packed FP4 dtypes have no Rust element type here; read their bytes with
/// [`Tensor::as_bytes`](crate::Tensor::as_bytes).
pub trait Element: bytemuck::Pod + Send + Sync + fmt::Debug + 'static + private::Sealed {
    /// The dtype this type represents.
    const DTYPE: DType;
}

mod private {
    pub trait Sealed {}
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl private::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
        }
    )*};
}

element!(f32 => F32, bf16 => BF16, f16 => F16, u8 => U8, u32 => U32, i32 => I32, u64 => U64, i64 => I64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        let err = "f13".parse::<DType>().unwrap_err().to_string();
        assert!(
            err.contains("unknown dtype `f13`") && err.contains("bf16"),
            "{err}"
        );
    }

    #[test]
    fn element_sizes_match_dtypes() {
        fn check<T: Element>() {
            assert_eq!(size_of::<T>(), T::DTYPE.size_in_bytes());
        }
        check::<f32>();
        check::<bf16>();
        check::<f16>();
        check::<u8>();
        check::<u32>();
        check::<i32>();
        check::<u64>();
        check::<i64>();
    }
}
