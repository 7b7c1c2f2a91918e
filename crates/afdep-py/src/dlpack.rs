//! Tensors borrowed through DLPack capsules (`torch.utils.dlpack.to_dlpack`): the data
//! pointer, device, dtype, shape and strides, checked against what a layer function needs.
//!
//! The capsule is not consumed: its producer frees the tensor when the capsule is collected,
//! and the caller keeps the capsule (and the tensor) alive for the whole call.

use std::ffi::c_void;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// DLPack's device types used here.
const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;

/// The element types the layer functions take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// bfloat16.
    Bf16,
    /// 32-bit signed integer (expert ids).
    I32,
}

impl DType {
    fn from_dl(t: DlDataType) -> Option<DType> {
        match (t.code, t.bits, t.lanes) {
            (2, 32, 1) => Some(DType::F32),
            (4, 16, 1) => Some(DType::Bf16),
            (0, 32, 1) => Some(DType::I32),
            _ => None,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 => 2,
            DType::F32 | DType::I32 => 4,
        }
    }

    /// The torch name.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "torch.float32",
            DType::Bf16 => "torch.bfloat16",
            DType::I32 => "torch.int32",
        }
    }
}

/// A DLPack dtype's torch name (for errors).
fn dl_name(t: DlDataType) -> String {
    let kind = match t.code {
        0 => "int",
        1 => "uint",
        2 => "float",
        4 => "bfloat",
        5 => "complex",
        6 => "bool",
        _ => "",
    };
    if kind.is_empty() || t.lanes != 1 {
        format!(
            "a DLPack dtype (code {} bits {} lanes {})",
            t.code, t.bits, t.lanes
        )
    } else {
        format!("torch.{kind}{}", t.bits)
    }
}

/// Where a tensor lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// CUDA device with this ordinal.
    Cuda(usize),
}

/// A contiguous tensor borrowed from a DLPack capsule.
#[derive(Debug, Clone)]
pub struct View {
    /// The argument's name, for errors.
    pub name: String,
    /// First element (data + byte offset); dangling-but-unused when empty.
    pub ptr: *mut u8,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// Device.
    pub device: Device,
}

impl View {
    /// Reads the capsule `cap` (named `name` in errors); non-contiguous tensors, unknown
    /// devices and dtypes are Python exceptions naming the tensor.
    pub fn new(name: &str, cap: &Bound<'_, PyAny>) -> PyResult<View> {
        // SAFETY: PyCapsule_GetPointer checks the capsule's type and name and sets a Python
        // error (returning null) when it is not a live "dltensor" capsule.
        let p = unsafe { pyo3::ffi::PyCapsule_GetPointer(cap.as_ptr(), c"dltensor".as_ptr()) };
        if p.is_null() {
            return Err(PyErr::take(cap.py()).unwrap_or_else(|| {
                PyTypeError::new_err(format!("`{name}`: not a DLPack capsule"))
            }));
        }
        // SAFETY: a "dltensor" capsule holds a DLManagedTensor whose first member is the
        // DLTensor; it stays valid while the capsule lives (the caller holds it).
        let t = unsafe { &*(p as *const DlTensor) };
        let ndim = usize::try_from(t.ndim).unwrap_or(0);
        // SAFETY: DLPack's shape (and strides, when not null) have ndim elements.
        let shape_i: &[i64] = if ndim == 0 {
            &[]
        } else {
            unsafe { std::slice::from_raw_parts(t.shape, ndim) }
        };
        let shape: Vec<usize> = shape_i.iter().map(|&d| d.max(0) as usize).collect();
        let dtype = DType::from_dl(t.dtype).ok_or_else(|| {
            PyTypeError::new_err(format!(
                "`{name}` is {}: expected torch.float32, torch.bfloat16 or torch.int32",
                dl_name(t.dtype)
            ))
        })?;
        let device = match t.device.device_type {
            KDL_CPU => Device::Cpu,
            KDL_CUDA => Device::Cuda(t.device.device_id.max(0) as usize),
            other => {
                return Err(PyValueError::new_err(format!(
                    "`{name}`: DLPack device type {other} is neither the CPU nor CUDA"
                )));
            }
        };
        let numel: usize = shape.iter().product();
        if !t.strides.is_null() && numel > 0 {
            // SAFETY: see above.
            let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
            let mut want = 1i64;
            for (d, (&n, &s)) in shape_i.iter().zip(strides).enumerate().rev() {
                if n != 1 && s != want {
                    return Err(PyValueError::new_err(format!(
                        "`{name}` is not contiguous (shape {shape:?}, strides {strides:?}: \
                         dimension {d} has stride {s}, a contiguous tensor has {want}); \
                         call .contiguous()"
                    )));
                }
                want *= n;
            }
        }
        // SAFETY: data + byte_offset is the first element (DLPack).
        let ptr = unsafe { (t.data as *mut u8).add(t.byte_offset as usize) };
        Ok(View {
            name: name.to_string(),
            ptr,
            shape,
            dtype,
            device,
        })
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The bytes it spans, `[start, end)` (empty for an empty tensor).
    pub fn span(&self) -> std::ops::Range<usize> {
        let start = self.ptr as usize;
        start..start + self.numel() * self.dtype.size()
    }

    /// Whether the two tensors share a byte (empty tensors share none).
    pub fn overlaps(&self, other: &View) -> bool {
        let (a, b) = (self.span(), other.span());
        !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end
    }

    /// Checks the shape.
    pub fn expect_shape(&self, want: &[usize]) -> PyResult<()> {
        if self.shape != want {
            return Err(PyValueError::new_err(format!(
                "`{}` has shape {:?}, the layer needs {:?}",
                self.name, self.shape, want
            )));
        }
        Ok(())
    }

    /// Checks the dtype.
    pub fn expect_dtype(&self, want: &[DType]) -> PyResult<()> {
        if !want.contains(&self.dtype) {
            let names: Vec<_> = want.iter().map(|d| d.name()).collect();
            return Err(PyTypeError::new_err(format!(
                "`{}` is {}, expected {}",
                self.name,
                self.dtype.name(),
                names.join(" or ")
            )));
        }
        Ok(())
    }

    /// Checks the device.
    pub fn expect_device(&self, want: Device) -> PyResult<()> {
        if self.device != want {
            return Err(PyValueError::new_err(format!(
                "`{}` is on {:?}, the other tensors are on {:?}",
                self.name, self.device, want
            )));
        }
        Ok(())
    }

    /// Refuses a view that is not a CPU tensor of one of `dtypes` (the host-side reads and
    /// writes below dereference its pointer).
    fn expect_host(&self, dtypes: &[DType]) -> PyResult<()> {
        self.expect_device(Device::Cpu)?;
        self.expect_dtype(dtypes)
    }

    /// The elements as f32 (exact for bf16); a view that is not a CPU tensor of dtype f32 or
    /// bf16 is a Python exception.
    ///
    /// # Safety
    /// The DLPack capsule this view was read from (and so the tensor's memory) must be alive
    /// for the call, and nothing may write the tensor during it.
    pub unsafe fn read_f32(&self) -> PyResult<Vec<f32>> {
        self.expect_host(&[DType::F32, DType::Bf16])?;
        let n = self.numel();
        if n == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: a CPU tensor of n contiguous elements of its dtype (checked above and by
        // View::new); alive and not written during the call (the caller's contract).
        Ok(unsafe {
            match self.dtype {
                DType::F32 => std::slice::from_raw_parts(self.ptr as *const f32, n).to_vec(),
                DType::Bf16 => std::slice::from_raw_parts(self.ptr as *const half::bf16, n)
                    .iter()
                    .map(|v| v.to_f32())
                    .collect(),
                DType::I32 => unreachable!("expect_host admitted f32 and bf16 only"),
            }
        })
    }

    /// The elements of an i32 CPU tensor (anything else is a Python exception).
    ///
    /// # Safety
    /// As for [`View::read_f32`].
    pub unsafe fn read_i32(&self) -> PyResult<Vec<i32>> {
        self.expect_host(&[DType::I32])?;
        let n = self.numel();
        if n == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: as in read_f32.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr as *const i32, n).to_vec() })
    }

    /// Writes `v` (one cast to the tensor's dtype: f32 or bf16) into a CPU tensor (anything
    /// else is a Python exception).
    ///
    /// # Safety
    /// The DLPack capsule this view was read from must be alive for the call, the tensor
    /// writable, and nothing else may read or write it during the call.
    pub unsafe fn write_f32(&self, v: &[f32]) -> PyResult<()> {
        self.expect_host(&[DType::F32, DType::Bf16])?;
        let n = self.numel();
        if v.len() != n {
            return Err(PyValueError::new_err(format!(
                "`{}` has {n} elements, the result has {}",
                self.name,
                v.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        // SAFETY: a checked CPU tensor of n elements of its dtype; alive, writable and not
        // otherwise accessed during the call (the caller's contract).
        unsafe {
            match self.dtype {
                DType::F32 => {
                    std::slice::from_raw_parts_mut(self.ptr as *mut f32, n).copy_from_slice(v)
                }
                DType::Bf16 => {
                    let d = std::slice::from_raw_parts_mut(self.ptr as *mut half::bf16, n);
                    for (d, s) in d.iter_mut().zip(v) {
                        *d = half::bf16::from_f32(*s);
                    }
                }
                DType::I32 => unreachable!("expect_host admitted f32 and bf16 only"),
            }
        }
        Ok(())
    }

    /// Writes i32 values into an i32 CPU tensor (anything else is a Python exception).
    ///
    /// # Safety
    /// As for [`View::write_f32`].
    pub unsafe fn write_i32(&self, v: &[i32]) -> PyResult<()> {
        self.expect_host(&[DType::I32])?;
        if v.len() != self.numel() {
            return Err(PyValueError::new_err(format!(
                "`{}` has {} elements, the result has {}",
                self.name,
                self.numel(),
                v.len()
            )));
        }
        if v.is_empty() {
            return Ok(());
        }
        // SAFETY: as in write_f32.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut i32, v.len()) }.copy_from_slice(v);
        Ok(())
    }
}
