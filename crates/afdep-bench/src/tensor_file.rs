//! Reading and writing tensors as safetensors files.
//!
//! Tensor names used by the CLI (documented in the README):
//! - layer inputs: `x` (T × H), `wr`, `w1`, `w3`, `w2`, `s1`, `s3`, `s2` (shapes of
//!   [`afdep_core::oracle::LayerParams`]), `dy` (T × H, for the train step); metadata `top_k`
//!   and `renormalize`;
//! - layer outputs: `y` (T × H) and one gradient per input: `dx`, `dwr`, `dw1`, `dw3`, `dw2`,
//!   `ds1`, `ds3`, `ds2`;
//! - exchange inputs: per attention rank `r`: `x.r` (T_r × H, bf16), `topk_idx.r` (T_r × K,
//!   i32), `topk_weights.r` (T_r × K, f32); optionally the experts `w1`, `w3`, `w2`;
//! - exchange outputs: `y.r` (T_r × H) per attention rank.
//!
//! Tensors read as bf16 ([`TensorFile::bf16`]) may be stored as bf16, f32 or f16: f32 and f16
//! are rounded to bf16 (to nearest even; the first conversion of a file is said once in the
//! log, at `info`); any other dtype is a [`TensorError::Dtype`] naming the tensor and its dtype.

use std::cell::Cell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use thiserror::Error;

/// Why a tensor of a file cannot be read as asked.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum TensorError {
    /// No tensor of that name.
    #[error("tensor `{name}` is missing")]
    Missing {
        /// The tensor.
        name: String,
    },
    /// The tensor's dtype is not one this read accepts.
    #[error("tensor `{name}` is {dtype}: expected {expected}")]
    Dtype {
        /// The tensor.
        name: String,
        /// Its dtype, as the file names it.
        dtype: String,
        /// What is accepted.
        expected: &'static str,
    },
    /// The data does not hold shape × element size bytes.
    #[error("tensor `{name}`: shape {shape:?} does not match {bytes} bytes")]
    Size {
        /// The tensor.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
        /// Its bytes.
        bytes: usize,
    },
}

/// One tensor held in memory.
#[derive(Debug, Clone)]
pub struct Tensor {
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Raw little-endian bytes.
    pub bytes: Vec<u8>,
}

/// A set of named tensors plus string metadata.
#[derive(Debug, Clone, Default)]
pub struct TensorFile {
    /// Tensors by name.
    pub tensors: HashMap<String, Tensor>,
    /// The file's `__metadata__`.
    pub metadata: HashMap<String, String>,
    /// The file it was read from.
    pub path: Option<PathBuf>,
    /// Whether a conversion to bf16 was logged already.
    said_conversion: Cell<bool>,
}

fn dtype_size(d: Dtype) -> usize {
    match d {
        Dtype::BF16 | Dtype::F16 | Dtype::I16 | Dtype::U16 => 2,
        Dtype::F32 | Dtype::I32 | Dtype::U32 => 4,
        Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
        _ => 1,
    }
}

impl TensorFile {
    /// Reads a safetensors file.
    pub fn read(path: &Path) -> Result<Self> {
        let buf = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        crate::safetensors_guard::check_offsets(&buf)
            .with_context(|| format!("parsing {} as safetensors", path.display()))?;
        let st = SafeTensors::deserialize(&buf)
            .with_context(|| format!("parsing {} as safetensors", path.display()))?;
        let (_, meta) = SafeTensors::read_metadata(&buf)?;
        let mut tensors = HashMap::new();
        for (name, view) in st.tensors() {
            tensors.insert(
                name,
                Tensor {
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    bytes: view.data().to_vec(),
                },
            );
        }
        Ok(TensorFile {
            tensors,
            metadata: meta.metadata().clone().unwrap_or_default(),
            path: Some(path.to_path_buf()),
            said_conversion: Cell::new(false),
        })
    }

    /// Writes the tensors (sorted by name) and metadata to `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut views = Vec::new();
        let mut names: Vec<&String> = self.tensors.keys().collect();
        names.sort();
        for n in names {
            let t = &self.tensors[n];
            views.push((
                n.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.bytes)?,
            ));
        }
        let meta = (!self.metadata.is_empty()).then(|| self.metadata.clone());
        safetensors::serialize_to_file(views, &meta, path)
            .with_context(|| format!("writing {}", path.display()))
    }

    /// Whether a tensor is present.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The tensor `name` if its dtype is one of `dtypes` and its size matches its shape.
    fn get_any(
        &self,
        name: &str,
        dtypes: &[Dtype],
        expected: &'static str,
    ) -> Result<&Tensor, TensorError> {
        let t = self.tensors.get(name).ok_or_else(|| TensorError::Missing {
            name: name.to_string(),
        })?;
        if !dtypes.contains(&t.dtype) {
            return Err(TensorError::Dtype {
                name: name.to_string(),
                dtype: format!("{:?}", t.dtype),
                expected,
            });
        }
        let n: usize = t.shape.iter().product();
        if n * dtype_size(t.dtype) != t.bytes.len() {
            return Err(TensorError::Size {
                name: name.to_string(),
                shape: t.shape.clone(),
                bytes: t.bytes.len(),
            });
        }
        Ok(t)
    }

    fn get(&self, name: &str, dtype: Dtype, expected: &'static str) -> Result<&Tensor> {
        Ok(self.get_any(name, &[dtype], expected)?)
    }

    /// A tensor as bf16: its shape and values. Stored as bf16, f32 or f16 (rounded to bf16,
    /// to nearest even; the file's first conversion is logged once); any other dtype is a
    /// [`TensorError::Dtype`].
    pub fn bf16(&self, name: &str) -> Result<(Vec<usize>, Vec<bf16>)> {
        let t = self.get_any(
            name,
            &[Dtype::BF16, Dtype::F32, Dtype::F16],
            "BF16 (or F32 / F16, converted to bf16)",
        )?;
        let v: Vec<bf16> = match t.dtype {
            Dtype::BF16 => t
                .bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                .collect(),
            Dtype::F16 => t
                .bytes
                .chunks_exact(2)
                .map(|c| bf16::from_f32(f16::from_le_bytes([c[0], c[1]]).to_f32()))
                .collect(),
            _ => t
                .bytes
                .chunks_exact(4)
                .map(|c| bf16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
        };
        if t.dtype != Dtype::BF16 && !self.said_conversion.replace(true) {
            tracing::info!(
                file = %self.path.as_deref().map_or_else(|| "-".into(), |p| p.display().to_string()),
                first = name,
                dtype = ?t.dtype,
                "converting f32 / f16 tensors to bf16 (round to nearest even); said once per file"
            );
        }
        Ok((t.shape.clone(), v))
    }

    /// An i32 tensor.
    pub fn i32(&self, name: &str) -> Result<(Vec<usize>, Vec<i32>)> {
        let t = self.get(name, Dtype::I32, "I32")?;
        Ok((
            t.shape.clone(),
            t.bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ))
    }

    /// An f32 tensor.
    pub fn f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let t = self.get(name, Dtype::F32, "F32")?;
        Ok((
            t.shape.clone(),
            t.bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ))
    }

    /// Adds a bf16 tensor.
    pub fn put_bf16(&mut self, name: &str, shape: &[usize], v: &[bf16]) {
        self.put(
            name,
            Dtype::BF16,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        );
    }

    /// Adds an i32 tensor.
    pub fn put_i32(&mut self, name: &str, shape: &[usize], v: &[i32]) {
        self.put(
            name,
            Dtype::I32,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        );
    }

    fn put(&mut self, name: &str, dtype: Dtype, shape: &[usize], bytes: Vec<u8>) {
        assert_eq!(
            shape.iter().product::<usize>() * dtype_size(dtype),
            bytes.len(),
            "{name}: shape and data disagree"
        );
        self.tensors.insert(
            name.to_string(),
            Tensor {
                dtype,
                shape: shape.to_vec(),
                bytes,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.safetensors");
        let mut f = TensorFile::default();
        let v: Vec<bf16> = (0..6).map(|i| bf16::from_f32(i as f32 * 0.5)).collect();
        f.put_bf16("x", &[2, 3], &v);
        f.put(
            "i",
            Dtype::I32,
            &[3],
            [-1i32, 0, 7].iter().flat_map(|v| v.to_le_bytes()).collect(),
        );
        f.put("w", Dtype::F32, &[1], 0.25f32.to_le_bytes().to_vec());
        f.metadata.insert("top_k".into(), "2".into());
        f.write(&p).unwrap();
        let g = TensorFile::read(&p).unwrap();
        assert_eq!(g.bf16("x").unwrap(), (vec![2, 3], v));
        assert_eq!(g.i32("i").unwrap().1, vec![-1, 0, 7]);
        assert_eq!(g.f32("w").unwrap().1, vec![0.25]);
        assert_eq!(g.metadata["top_k"], "2");
        assert!(g.f32("x").is_err());
        assert!(g.bf16("nope").is_err());
    }

    #[test]
    fn f32_and_f16_read_as_bf16_other_dtypes_are_typed_errors() {
        let mut f = TensorFile::default();
        let vals = [1.0f32, -2.5, 3.140625, 1e-3, 65504.0, 1.0 + 1.0 / 256.0];
        f.put(
            "a32",
            Dtype::F32,
            &[2, 3],
            vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        );
        f.put(
            "a16",
            Dtype::F16,
            &[6],
            vals.iter()
                .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                .collect(),
        );
        f.put("i8", Dtype::I8, &[2], vec![1, 2]);
        f.put("f64", Dtype::F64, &[1], 1.0f64.to_le_bytes().to_vec());
        let want: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(f.bf16("a32").unwrap(), (vec![2, 3], want.clone()));
        // f16 first (exact for these), then to bf16
        let want16: Vec<bf16> = vals
            .iter()
            .map(|&v| bf16::from_f32(f16::from_f32(v).to_f32()))
            .collect();
        assert_eq!(f.bf16("a16").unwrap().1, want16);
        // 1 + 2^-8 is a tie in bf16: to even (1.0)
        assert_eq!(f.bf16("a32").unwrap().1[5], bf16::from_f32(1.0));
        for (name, dt) in [("i8", "I8"), ("f64", "F64")] {
            let e = f.bf16(name).unwrap_err();
            let te = e.downcast_ref::<TensorError>().expect("a typed error");
            assert!(
                matches!(te, TensorError::Dtype { name: n, dtype, .. } if n == name && dtype == dt),
                "{te}"
            );
            assert!(e.to_string().contains(name) && e.to_string().contains(dt));
        }
        assert_eq!(
            *f.bf16("zz")
                .unwrap_err()
                .downcast_ref::<TensorError>()
                .unwrap(),
            TensorError::Missing { name: "zz".into() }
        );
        // a size that disagrees with the shape
        f.tensors.get_mut("a32").unwrap().bytes.pop();
        assert!(matches!(
            f.bf16("a32").unwrap_err().downcast_ref::<TensorError>(),
            Some(TensorError::Size { .. })
        ));
    }
}
