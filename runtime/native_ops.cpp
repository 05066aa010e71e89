// picompile_native: the one-token TVM kernel calls of a decode step as C++ torch ops.
//
// The Python ops (picompile.ir.ops.tvm_linear / tvm_sparse_ffn / tvm_predict) turn a mask into row indices,
// allocate the output and call the kernel through tvm_ffi's Python binding. Here the same work is done in
// C++, and the kernel is called through the TVM-FFI C ABI (TVMFFIFunctionCall on the handle of the loaded
// function), so a compiled decode step whose wrapper is C++ (inductor's cpp_wrapper) calls its kernels
// without entering Python. Arguments go to the kernel in its PrimFunc order, optional ones left out.
// A graph names its kernel by a stable id (a hash of the kernel's key, registered with set_kernel at load),
// not by the handle's address: the graph's code is then the same in every process, so TorchInductor's
// on-disk cache finds it again.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tvm/ffi/c_api.h>

#include <cmath>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

DLDataType dl_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DLDataType{kDLFloat, 32, 1};
    case at::kHalf: return DLDataType{kDLFloat, 16, 1};
    case at::kInt: return DLDataType{kDLInt, 32, 1};
    case at::kChar: return DLDataType{kDLInt, 8, 1};
    case at::kByte: return DLDataType{kDLUInt, 8, 1};  // int4 quants (two per byte)
    default: TORCH_CHECK(false, "picompile_native: unsupported dtype ", t.scalar_type());
  }
}

// a contiguous, 64-byte aligned view of t (t itself in the usual case), as the kernels require
at::Tensor aligned(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 64 == 0) return c;
  at::Tensor out = at::empty(c.sizes(), c.options());  // CPU allocations are 64-byte aligned
  return out.copy_(c);
}

std::mutex kernels_lock;
std::unordered_map<int64_t, int64_t>& kernels() {  // kernel id -> the loaded function's handle
  static std::unordered_map<int64_t, int64_t> table;
  return table;
}

void set_kernel(int64_t id, int64_t handle) {
  std::lock_guard<std::mutex> guard(kernels_lock);
  kernels()[id] = handle;
}

void call(int64_t kernel, const std::vector<at::Tensor>& args) {
  int64_t handle = 0;
  {
    std::lock_guard<std::mutex> guard(kernels_lock);
    auto it = kernels().find(kernel);
    TORCH_CHECK(it != kernels().end(), "picompile_native: kernel id ", kernel, " was never registered");
    handle = it->second;
  }
  std::vector<DLTensor> dl(args.size());
  std::vector<TVMFFIAny> packed(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    const at::Tensor& t = args[i];
    dl[i].data = t.data_ptr();
    dl[i].device = DLDevice{kDLCPU, 0};
    dl[i].ndim = static_cast<int32_t>(t.dim());
    dl[i].dtype = dl_dtype(t);
    dl[i].shape = const_cast<int64_t*>(t.sizes().data());
    dl[i].strides = nullptr;  // compact row-major (every argument is contiguous)
    dl[i].byte_offset = 0;
    packed[i].type_index = kTVMFFIDLTensorPtr;
    packed[i].zero_padding = 0;
    packed[i].v_ptr = &dl[i];
  }
  TVMFFIAny result;
  result.type_index = kTVMFFINone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  int rc = TVMFFIFunctionCall(reinterpret_cast<TVMFFIObjectHandle>(handle), packed.data(),
                              static_cast<int32_t>(packed.size()), &result);
  if (rc != 0) {
    TVMFFIObjectHandle err = nullptr;
    TVMFFIErrorMoveFromRaised(&err);
    if (err != nullptr) TVMFFIObjectDecRef(err);
    TORCH_CHECK(false, "picompile_native: the TVM kernel call failed (code ", rc, ")");
  }
}

at::Tensor all_rows(int64_t n) {  // int32 [n]: 0..n-1, made once per n
  static std::map<int64_t, at::Tensor> cache;
  static std::mutex lock;
  std::lock_guard<std::mutex> guard(lock);
  auto it = cache.find(n);
  if (it == cache.end()) it = cache.emplace(n, at::arange(n, at::TensorOptions().dtype(at::kInt))).first;
  return it->second;
}

at::Tensor rows_of(const at::Tensor& mask) {  // int32 [k]: the positions of the true entries, in order
  at::Tensor m = mask.reshape({-1}).contiguous();
  const bool* p = m.data_ptr<bool>();
  const int64_t n = m.numel();
  at::Tensor idx = at::empty({n}, at::TensorOptions().dtype(at::kInt));
  int32_t* out = idx.data_ptr<int32_t>();
  int64_t k = 0;
  for (int64_t i = 0; i < n; ++i) {  // branchless: write every position, advance past the active ones
    out[k] = static_cast<int32_t>(i);
    k += p[i] ? 1 : 0;
  }
  return idx.slice(0, 0, k);  // contiguous, starting where idx does (aligned)
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
  s.back() = n;
  return s;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, int64_t kernel) {
  TORCH_CHECK(x.numel() == x.size(-1), "picompile_native::gemv takes one token");
  at::Tensor y = at::empty({w.size(0)}, x.options());  // [d_out]
  call(kernel, {aligned(x.reshape({-1})), w, all_rows(w.size(0)), y});
  if (b.has_value()) y.add_(*b);
  return y.view(out_shape(x, w.size(0)));
}

at::Tensor sparse_ffn(const at::Tensor& x, const at::Tensor& w_up, const std::optional<at::Tensor>& b_up,
                      const std::optional<at::Tensor>& w_gate, const at::Tensor& w_down_t,
                      const std::optional<at::Tensor>& mask, int64_t kernel) {
  const int64_t d = x.size(-1);
  TORCH_CHECK(x.numel() == d, "picompile_native::sparse_ffn takes one token");
  at::Tensor y = at::empty({d}, x.options());  // [d_model]
  at::Tensor idx = mask.has_value() ? rows_of(*mask) : all_rows(w_up.size(0));  // [k]
  if (idx.numel() == 0) return y.zero_().view(x.sizes());
  std::vector<at::Tensor> args{aligned(x.reshape({-1})), w_up};
  if (w_gate.has_value()) args.push_back(*w_gate);
  if (b_up.has_value()) args.push_back(*b_up);
  args.push_back(w_down_t);
  args.push_back(idx);
  args.push_back(y);
  call(kernel, args);
  return y.view(x.sizes());
}

// quantized weights (int8 / int4 quants + float16 scales, kernels/qformat.py): each weight is passed as its
// quants then its scales, b_up after the gate (kernels.loader.call_args)
at::Tensor qgemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, const std::optional<at::Tensor>& b,
                 int64_t kernel) {
  TORCH_CHECK(x.numel() == x.size(-1), "picompile_native::qgemv takes one token");
  at::Tensor y = at::empty({w.size(0)}, x.options());  // [d_out]
  call(kernel, {aligned(x.reshape({-1})), w, s, all_rows(w.size(0)), y});
  if (b.has_value()) y.add_(*b);
  return y.view(out_shape(x, w.size(0)));
}

at::Tensor qsparse_ffn(const at::Tensor& x, const at::Tensor& w_up, const at::Tensor& s_up,
                       const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& w_gate,
                       const std::optional<at::Tensor>& s_gate, const at::Tensor& w_down_t, const at::Tensor& s_down,
                       const std::optional<at::Tensor>& mask, int64_t kernel) {
  const int64_t d = x.size(-1);
  TORCH_CHECK(x.numel() == d, "picompile_native::qsparse_ffn takes one token");
  TORCH_CHECK(w_gate.has_value() == s_gate.has_value(), "picompile_native::qsparse_ffn: a gate needs its scales");
  at::Tensor y = at::empty({d}, x.options());  // [d_model]
  at::Tensor idx = mask.has_value() ? rows_of(*mask) : all_rows(w_up.size(0));  // [k]
  if (idx.numel() == 0) return y.zero_().view(x.sizes());
  std::vector<at::Tensor> args{aligned(x.reshape({-1})), w_up, s_up};
  if (w_gate.has_value()) {
    args.push_back(*w_gate);
    args.push_back(*s_gate);
  }
  if (b_up.has_value()) args.push_back(*b_up);
  args.push_back(w_down_t);
  args.push_back(s_down);
  args.push_back(idx);
  args.push_back(y);
  call(kernel, args);
  return y.view(x.sizes());
}

at::Tensor predict(const at::Tensor& x, const at::Tensor& fc1, const at::Tensor& fc2,
                   const std::optional<at::Tensor>& offset, const at::Tensor& thr, int64_t kernel) {
  TORCH_CHECK(x.numel() == x.size(-1), "picompile_native::predict takes one token");
  at::Tensor mask = at::empty({fc2.size(0)}, x.options().dtype(at::kChar));  // [n_neurons], written 0/1
  std::vector<at::Tensor> args{aligned(x.reshape({-1})), fc1, fc2};
  if (offset.has_value()) args.push_back(*offset);
  args.push_back(thr);
  args.push_back(mask);
  call(kernel, args);
  return mask.view(at::kBool).view(out_shape(x, fc2.size(0)));
}

at::Tensor all_channels(int64_t n) {  // int8 [n]: every input channel read, made once per n
  static std::map<int64_t, at::Tensor> cache;
  static std::mutex lock;
  std::lock_guard<std::mutex> guard(lock);
  auto it = cache.find(n);
  if (it == cache.end()) it = cache.emplace(n, at::ones({n}, at::TensorOptions().dtype(at::kChar))).first;
  return it->second;
}

// an input-sparse linear (TEAL-style, kernel kind "input_sparse"): y = sum over the active input channels i of
// x_i * w_t[i] (+ b); the kernel reads the int8 mask itself
at::Tensor input_sparse(const at::Tensor& x, const at::Tensor& w_t, const std::optional<at::Tensor>& b,
                        const std::optional<at::Tensor>& mask, int64_t kernel) {
  const int64_t d_in = x.size(-1);
  TORCH_CHECK(x.numel() == d_in, "picompile_native::input_sparse takes one token");
  at::Tensor y = at::empty({w_t.size(1)}, x.options());  // [d_out]
  at::Tensor m = mask.has_value() ? mask->reshape({d_in}).contiguous().view(at::kChar) : all_channels(d_in);
  call(kernel, {aligned(x.reshape({-1})), m, w_t, y});
  if (b.has_value()) y.add_(*b);
  return y.view(out_shape(x, w_t.size(1)));
}

// -- the glue between the kernels (runtime/native_glue.py): the same aten ops, called from C++ -----------------
// Each is the exact op sequence the graph ran (so the same floats, bit for bit), dispatched from C++: one
// Python call for what took five to eleven.

// RMSNorm as HF's Llama writes it: w * (x * rsqrt(mean(x^2, -1) + eps))
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor r = at::rsqrt(at::add(at::mean(at::pow(x, 2), {-1}, true), eps));
  return at::mul(w, at::mul(x, r));
}

// rotary embedding, rotate-half form: x * cos + cat(-x[..., half:], x[..., :half]) * sin
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t half) {
  const int64_t d = x.dim() - 1;
  at::Tensor rot = at::cat({at::neg(x.slice(d, half)), x.slice(d, 0, half)}, -1);
  return at::add(at::mul(x, cos), at::mul(rot, sin));
}

// runtime/decode_attention.grouped_attention: q [b, hq, s, e], k / v [b, hkv, L, e], mask bool or additive
at::Tensor grouped_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::optional<at::Tensor>& mask, std::optional<double> scale) {
  const int64_t b = q.size(0), hq = q.size(1), s = q.size(2), e = q.size(3);
  const int64_t hkv = k.size(1), length = k.size(2), g = hq / hkv;
  at::Tensor qg = q.reshape({b, hkv, g * s, e});  // a KV head's query heads stacked
  at::Tensor scores = at::mul(at::matmul(qg, k.transpose(-1, -2)),
                              scale.has_value() ? *scale : std::pow(static_cast<double>(e), -0.5));
  if (mask.has_value()) {
    at::Tensor m = mask->expand({b, hq, s, length}).reshape({b, hkv, g * s, length});
    scores = m.scalar_type() == at::kBool ? scores.masked_fill(at::bitwise_not(m), -INFINITY) : at::add(scores, m);
  }
  return at::matmul(at::softmax(scores, -1), v).reshape({b, hq, s, e});
}

}  // namespace

TORCH_LIBRARY(picompile_native, m) {
  m.def("set_kernel(int id, int handle) -> ()", &set_kernel);
  m.def("gemv(Tensor x, Tensor w, Tensor? b, int kernel) -> Tensor");
  m.def("sparse_ffn(Tensor x, Tensor w_up, Tensor? b_up, Tensor? w_gate, Tensor w_down_t, Tensor? mask, int kernel) -> Tensor");
  m.def("qgemv(Tensor x, Tensor w, Tensor s, Tensor? b, int kernel) -> Tensor");
  m.def("qsparse_ffn(Tensor x, Tensor w_up, Tensor s_up, Tensor? b_up, Tensor? w_gate, Tensor? s_gate, Tensor w_down_t, Tensor s_down, Tensor? mask, int kernel) -> Tensor");
  m.def("predict(Tensor x, Tensor fc1, Tensor fc2, Tensor? offset, Tensor thr, int kernel) -> Tensor");
  m.def("input_sparse(Tensor x, Tensor w_t, Tensor? b, Tensor? mask, int kernel) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, int half) -> Tensor");
  m.def("grouped_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float? scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(picompile_native, CPU, m) {
  m.impl("gemv", &gemv);
  m.impl("sparse_ffn", &sparse_ffn);
  m.impl("qgemv", &qgemv);
  m.impl("qsparse_ffn", &qsparse_ffn);
  m.impl("predict", &predict);
  m.impl("input_sparse", &input_sparse);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("grouped_attention", &grouped_attention);
}
