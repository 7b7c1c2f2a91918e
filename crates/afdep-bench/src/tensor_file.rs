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

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use half::bf16;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

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

    fn get(&self, name: &str, dtype: Dtype) -> Result<&Tensor> {
        let t = self
            .tensors
            .get(name)
            .with_context(|| format!("tensor `{name}` is missing"))?;
        if t.dtype != dtype {
            bail!("tensor `{name}` is {:?}, expected {dtype:?}", t.dtype);
        }
        let n: usize = t.shape.iter().product();
        if n * dtype_size(dtype) != t.bytes.len() {
            bail!(
                "tensor `{name}`: shape {:?} does not match {} bytes",
                t.shape,
                t.bytes.len()
            );
        }
        Ok(t)
    }

    /// A bf16 tensor: its shape and values.
    pub fn bf16(&self, name: &str) -> Result<(Vec<usize>, Vec<bf16>)> {
        let t = self.get(name, Dtype::BF16)?;
        Ok((
            t.shape.clone(),
            t.bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ))
    }

    /// An i32 tensor.
    pub fn i32(&self, name: &str) -> Result<(Vec<usize>, Vec<i32>)> {
        let t = self.get(name, Dtype::I32)?;
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
        let t = self.get(name, Dtype::F32)?;
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
}
