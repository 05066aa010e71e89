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
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tvm/ffi/c_api.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <atomic>
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

// TVM's thread pool: TVMBackendParallelLaunch of the process's libtvm_runtime (c_backend_api.h), registered by
// set_parallel_launch at load. The one-token attention runs its KV heads on the pool's threads, which otherwise
// only wait between two kernel calls (a decode step's torch glue runs on one thread, runtime/threads.py).
struct ParallelEnv {  // TVMParallelGroupEnv
  void* sync_handle;
  int32_t num_task;
};
using ParallelLambda = int (*)(int task_id, ParallelEnv* penv, void* cdata);
using ParallelLaunch = int (*)(ParallelLambda flambda, void* cdata, int num_task);
std::atomic<ParallelLaunch> parallel_launch{nullptr};

void set_parallel_launch(int64_t address) { parallel_launch.store(reinterpret_cast<ParallelLaunch>(address)); }

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

// -- the glue between the kernels (runtime/native_glue.py) -------------------------------------------------
// One Python call for what took five to eleven aten calls. At one token (a decode step's shapes, float32) each
// op runs as one loop here (``*_direct``): an aten call costs ~1 µs of dispatch and an allocation for nanoseconds
// of work, and the 11 of grouped attention cost ~85 µs per layer at 64-100 cached tokens, ~20 % of a 1B int4
// step. Elsewhere (other dtypes, several tokens, a layout not handled) the same aten ops run as the graph wrote
// them. rotary's loop is the aten ops' floats bit for bit (each product and sum rounded as aten rounds it:
// fp-contract off); rms_norm's and attention's sums run in another order (float32 accumulators; relative
// differences ~1e-7, tests/test_native_glue.py).

// Vectorizable loops with runtime dispatch: each is compiled for AVX-512, AVX2 + FMA and baseline x86-64, and the
// loader picks the best this CPU has (the same library on every x86 machine; no -march).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PI_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PI_CLONES
#endif

constexpr int kLanes = 16;  // independent partial sums: one 512-bit or two 256-bit registers

// inlined into each dispatched function below, so each clone has its own vector form
inline __attribute__((always_inline)) float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int t = 0; t < kLanes; ++t) acc[t] += a[j + t] * b[j + t];
  for (int w = kLanes / 2; w > 0; w /= 2)  // a tree, not a chain of 16 dependent adds
    for (int t = 0; t < w; ++t) acc[t] += acc[t + w];
  float sum = acc[0];
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

PI_CLONES float sum_squares(const float* x, int64_t n) { return dot(x, x, n); }

bool float_last_contiguous(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.device().is_cpu() && t.dim() >= 1 && (t.size(-1) <= 1 || t.stride(-1) == 1);
}

// RMSNorm as HF's Llama writes it: w * (x * rsqrt(mean(x^2, -1) + eps))
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t d = x.dim() ? x.size(-1) : 0;
  if (float_last_contiguous(x) && w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == d && d > 0 &&
      w.is_contiguous() && x.numel() <= 64 * d) {  // rms_norm_direct: one row per token
    at::Tensor xc = x.contiguous();
    at::Tensor out = at::empty(x.sizes(), x.options());
    const float* xp = xc.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t r = 0, rows = x.numel() / d; r < rows; ++r) {
      const float* xr = xp + r * d;
      float* o = op + r * d;
      const float mean = sum_squares(xr, d) / static_cast<float>(d);
      const float inv = 1.f / std::sqrt(mean + static_cast<float>(eps));
      for (int64_t j = 0; j < d; ++j) o[j] = wp[j] * (xr[j] * inv);
    }
    return out;
  }
  at::Tensor r = at::rsqrt(at::add(at::mean(at::pow(x, 2), {-1}, true), eps));
  return at::mul(w, at::mul(x, r));
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// one row of 2 * half: o = x * c + cat(-x[half:], x[:half]) * sn, each product rounded before the add (rotary's and
// heads' one-position loops: the aten ops' floats)
inline void rotate_row(const float* xr, const float* c, const float* sn, int64_t half, float* o) {
  for (int64_t j = 0; j < half; ++j) {
    const float a = xr[j] * c[j], b = -xr[j + half] * sn[j];
    o[j] = a + b;
  }
  for (int64_t j = half; j < 2 * half; ++j) {
    const float a = xr[j] * c[j], b = xr[j - half] * sn[j];
    o[j] = a + b;
  }
}

// rotary embedding, rotate-half form: x * cos + cat(-x[..., half:], x[..., :half]) * sin
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t half) {
  const int64_t e = x.dim() ? x.size(-1) : 0;
  if (float_last_contiguous(x) && e == 2 * half && half > 0 && cos.scalar_type() == at::kFloat &&
      sin.scalar_type() == at::kFloat && cos.numel() == e && sin.numel() == e && cos.size(-1) == e &&
      sin.size(-1) == e && x.dim() >= cos.dim() && x.dim() >= sin.dim()) {  // rotary_direct: one position
    at::Tensor xc = x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
    at::Tensor out = at::empty(x.sizes(), x.options());
    const float* xp = xc.data_ptr<float>();
    const float* c = cc.data_ptr<float>();
    const float* sn = sc.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t r = 0, rows = x.numel() / e; r < rows; ++r) {
      const float* xr = xp + r * e;
      float* o = op + r * e;
      rotate_row(xr, c, sn, half, o);
    }
    return out;
  }
  const int64_t d = x.dim() - 1;
  at::Tensor rot = at::cat({at::neg(x.slice(d, half)), x.slice(d, 0, half)}, -1);
  return at::add(at::mul(x, cos), at::mul(rot, sin));
}
#pragma GCC pop_options

// -- attention_direct: one query position, AVX2 + FMA (both the AMX and the AVX-512 machines have them; another
// CPU takes the aten ops). Per KV head: q·kᵀ with each block of 4 key rows read once for its g query heads,
// softmax with a vectorized exp, then p·v with each block of 64 value rows read once for the g heads. One thread:
// it runs where that is faster than torch's matmuls on all threads (the extension is built without OpenMP) — up to
// ~256 cached tokens for 32 heads of 64 (1B, AMD Zen 4: 17.5 against 31.7 µs at 100 tokens, 47 / 51 at 300, 92 /
// 79 at 600 on two threads), at any length on one thread: a decode step whose weights all go through TVM kernels
// runs torch on one thread (runtime/threads.py), so there it always runs (293 against 363 µs at 2,000 tokens).
#if defined(__x86_64__) && defined(__GNUC__)
#define PI_HAVE_AVX2_PATH 1
#define PI_AVX2 __attribute__((target("avx2,fma")))

bool cpu_has_avx2_fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

// exp(x) for x <= 0 (softmax's shifted scores), float32, ~1 ulp: x = n·ln2 + r, |r| <= ln2/2, e^r by a degree-6
// polynomial (Cephes' expf coefficients), 2^n by the exponent bits; below -87.3 → 0
PI_AVX2 static inline __m256 exp_neg(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(under, y);
}

PI_AVX2 static inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// the sums of 4 vectors → [Σa0, Σa1, Σa2, Σa3]
PI_AVX2 static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
  __m256 t2 = _mm256_hadd_ps(t0, t1);
  return _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps(t2, 1));
}

// scores[l] = exp(scores[l] - max) for l < L → their sum
PI_AVX2 static float softmax_exp_avx2(float* scores, int64_t length) {
  float mx = -INFINITY;
  for (int64_t l = 0; l < length; ++l) mx = std::max(mx, scores[l]);
  if (!(mx > -INFINITY)) mx = 0.f;  // every key masked: exp(-inf) = 0 for all, the sum 0 (torch gives NaN too: 0/0)
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t l = 0;
  for (; l + 8 <= length; l += 8) {
    __m256 y = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(scores + l), m));
    _mm256_storeu_ps(scores + l, y);
    acc = _mm256_add_ps(acc, y);
  }
  float total = hsum(acc);
  if (l < length) {
    float tail[8];
    for (int t = 0; t < 8; ++t) tail[t] = l + t < length ? scores[l + t] - mx : -INFINITY;
    __m256 y = exp_neg(_mm256_loadu_ps(tail));
    _mm256_storeu_ps(tail, y);
    for (int t = 0; l + t < length; ++t) { scores[l + t] = tail[t]; total += tail[t]; }
  }
  return total;
}

// one KV head's g query heads at one query position: q [g, e] (row stride qs), k / v rows (strides ks / vs),
// out [g, e] (row stride os); scores: g * length floats of scratch; mask rows as attention_direct's
PI_AVX2 static void attend_group_avx2(const float* q, int64_t qs, int64_t g, const float* k, int64_t ks, const float* v,
                                      int64_t vs, int64_t length, int64_t e, float scale, const void* const* mask_rows,
                                      int64_t mstride, bool mask_bool, float* scores, float* out, int64_t os) {
  // q·kᵀ: each block of 4 key rows read once for the g heads (from L1, not once per head from L2 / L3)
  int64_t l = 0;
  for (; l + 4 <= length; l += 4) {
    const float *k0 = k + l * ks, *k1 = k0 + ks, *k2 = k1 + ks, *k3 = k2 + ks;
    for (int64_t h = 0; h < g; ++h) {
      const float* qh = q + h * qs;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t j = 0; j < e; j += 8) {
        __m256 qv = _mm256_loadu_ps(qh + j);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + j), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + j), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + j), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + j), a3);
      }
      _mm_storeu_ps(scores + h * length + l, _mm_mul_ps(hsum4(a0, a1, a2, a3), _mm_set1_ps(scale)));
    }
  }
  for (; l < length; ++l)
    for (int64_t h = 0; h < g; ++h) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t j = 0; j < e; j += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * qs + j), _mm256_loadu_ps(k + l * ks + j), a);
      scores[h * length + l] = hsum(a) * scale;
    }

  // mask: bool false drops a key, a float is added (rows: mask_rows[h], stride mstride; nullptr: none)
  if (mask_rows != nullptr)
    for (int64_t h = 0; h < g; ++h)
      for (int64_t i = 0; i < length; ++i) {
        float& sc = scores[h * length + i];
        if (mask_bool) {
          if (!static_cast<const bool*>(mask_rows[h])[i * mstride]) sc = -INFINITY;
        } else {
          sc += static_cast<const float*>(mask_rows[h])[i * mstride];
        }
      }
  float inv[64];
  for (int64_t h = 0; h < g; ++h) inv[h] = 1.f / softmax_exp_avx2(scores + h * length, length);
  // p·v: out rows start at zero, then each block of 64 value rows is read once for the g heads
  for (int64_t h = 0; h < g; ++h) std::fill(out + h * os, out + h * os + e, 0.f);
  for (int64_t l0 = 0; l0 < length; l0 += 64) {
    const int64_t l1 = std::min<int64_t>(length, l0 + 64);
    for (int64_t h = 0; h < g; ++h)
      for (int64_t j0 = 0; j0 < e; j0 += 64) {
        const int64_t n = std::min<int64_t>(64, e - j0) / 8;
        float* o = out + h * os + j0;
        __m256 acc[8];
        for (int t = 0; t < n; ++t) acc[t] = _mm256_loadu_ps(o + 8 * t);
        for (int64_t i = l0; i < l1; ++i) {
          const __m256 w = _mm256_set1_ps(scores[h * length + i]);
          const float* vr = v + i * vs + j0;
          for (int t = 0; t < n; ++t) acc[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * t), acc[t]);
        }
        for (int t = 0; t < n; ++t) _mm256_storeu_ps(o + 8 * t, acc[t]);
      }
  }
  for (int64_t h = 0; h < g; ++h) {
    const __m256 f = _mm256_set1_ps(inv[h]);
    for (int64_t j = 0; j < e; j += 8) _mm256_storeu_ps(out + h * os + j, _mm256_mul_ps(f, _mm256_loadu_ps(out + h * os + j)));
  }
}
#endif

// runtime/decode_attention.grouped_attention: q [b, hq, s, e], k / v [b, hkv, L, e], mask bool or additive
at::Tensor grouped_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::optional<at::Tensor>& mask, std::optional<double> scale) {
  const int64_t b = q.size(0), hq = q.size(1), s = q.size(2), e = q.size(3);
  const int64_t hkv = k.size(1), length = k.size(2), g = hq / hkv;
  const double sc = scale.has_value() ? *scale : std::pow(static_cast<double>(e), -0.5);
  const bool mask_ok = !mask.has_value() || ((mask->scalar_type() == at::kBool || mask->scalar_type() == at::kFloat) &&
                                             mask->dim() <= 4 && mask->device().is_cpu());
#ifdef PI_HAVE_AVX2_PATH
  if (s == 1 && length > 0 && hq == g * hkv && g <= 64 && e % 8 == 0 && q.dim() == 4 && k.dim() == 4 &&
      v.dim() == 4 && mask_ok && float_last_contiguous(q) && float_last_contiguous(k) && float_last_contiguous(v) &&
      k.size(0) == b && v.size(0) == b && v.size(1) == hkv && v.size(2) == length && k.size(3) == e &&
      v.size(3) == e && cpu_has_avx2_fma() && (at::get_num_threads() == 1 || hq * length * e <= (1 << 19))) {
    at::Tensor m;
    if (mask.has_value()) m = mask->expand({b, hq, s, length});  // strides 0 where it broadcasts
    at::Tensor out = at::empty({b, hq, s, e}, q.options());
    const float* qp = q.data_ptr<float>();
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const char* mp = m.defined() ? static_cast<const char*>(m.data_ptr()) : nullptr;
    const int64_t msize = m.defined() ? m.element_size() : 0;
    const bool mbool = m.defined() && m.scalar_type() == at::kBool;
    // the (batch, KV head) groups, each with its own scores: task t of n takes groups t, t + n, ...
    auto groups = [&](int64_t task, int64_t n_task) {
      std::vector<float> scores(g * length);
      std::vector<const void*> rows(g);
      for (int64_t i = task; i < b * hkv; i += n_task) {
        const int64_t bi = i / hkv, kv = i % hkv;
        for (int64_t h = 0; h < g && mp; ++h) rows[h] = mp + (bi * m.stride(0) + (kv * g + h) * m.stride(1)) * msize;
        attend_group_avx2(qp + bi * q.stride(0) + kv * g * q.stride(1), q.stride(1), g,
                          kp + bi * k.stride(0) + kv * k.stride(1), k.stride(2),
                          vp + bi * v.stride(0) + kv * v.stride(1), v.stride(2), length, e, static_cast<float>(sc),
                          mp ? rows.data() : nullptr, m.defined() ? m.stride(3) : 0, mbool, scores.data(),
                          op + (bi * hq + kv * g) * e, e);
      }
    };
    const ParallelLaunch launch = parallel_launch.load();
    // on the pool where there are several groups and enough work to pay for waking it (~a few µs): from 2 groups
    // of 8 heads × 64 at 32 cached tokens on
    if (launch != nullptr && b * hkv >= 2 && hq * length * e >= (1 << 15)) {
      auto task = [](int task_id, ParallelEnv* env, void* data) -> int {
        (*static_cast<decltype(groups)*>(data))(task_id, env->num_task);
        return 0;
      };
      if (launch(+task, &groups, 0) == 0) return out;  // 0 tasks: the pool's thread count
    }
    groups(0, 1);
    return out;
  }
#endif
  at::Tensor qg = q.reshape({b, hkv, g * s, e});  // a KV head's query heads stacked
  at::Tensor scores = at::mul(at::matmul(qg, k.transpose(-1, -2)), sc);
  if (mask.has_value()) {
    at::Tensor m = mask->expand({b, hq, s, length}).reshape({b, hkv, g * s, length});
    scores = m.scalar_type() == at::kBool ? scores.masked_fill(at::bitwise_not(m), -INFINITY) : at::add(scores, m);
  }
  return at::matmul(at::softmax(scores, -1), v).reshape({b, hq, s, e});
}

// A fused projection's heads (native_glue.fuse_heads): x[..., offset : offset + n * e] [b, s, n * e] as heads
// [b, n, s, e], rotated by rotary where cos and sin are given; a new contiguous tensor either way (what the slice /
// view / transpose / rotary chain computes, in one call). heads_direct: float32 x with a contiguous last dimension
// and one position's cos / sin (rotary_direct's case): the rows copied and rotated from x's memory, rotary_direct's
// sums in its order (the same floats); otherwise the aten views and rotary.
at::Tensor heads(const at::Tensor& x, int64_t offset, int64_t n, int64_t e, const std::optional<at::Tensor>& cos,
                 const std::optional<at::Tensor>& sin, int64_t half) {
  TORCH_CHECK(x.dim() == 3 && n > 0 && e > 0 && offset >= 0 && offset + n * e <= x.size(2),
              "picompile_native.heads: ", n, " heads of ", e, " at ", offset, " do not fit x ", x.sizes());
  TORCH_CHECK(cos.has_value() == sin.has_value(), "picompile_native.heads: cos and sin go together");
  const bool rotate = cos.has_value();
  if (float_last_contiguous(x) &&
      (!rotate || (e == 2 * half && half > 0 && cos->scalar_type() == at::kFloat && sin->scalar_type() == at::kFloat &&
                   cos->numel() == e && sin->numel() == e && cos->size(-1) == e && sin->size(-1) == e &&
                   cos->dim() <= 4 && sin->dim() <= 4))) {  // heads_direct
    const int64_t b = x.size(0), s = x.size(1);
    at::Tensor out = at::empty({b, n, s, e}, x.options());
    at::Tensor cc, sc;
    if (rotate) cc = cos->contiguous(), sc = sin->contiguous();
    const float* c = rotate ? cc.data_ptr<float>() : nullptr;
    const float* sn = rotate ? sc.data_ptr<float>() : nullptr;
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t h = 0; h < n; ++h)
        for (int64_t si = 0; si < s; ++si) {
          const float* xr = xp + bi * x.stride(0) + si * x.stride(1) + offset + h * e;
          float* o = op + ((bi * n + h) * s + si) * e;
          if (rotate)
            rotate_row(xr, c, sn, half, o);
          else
            std::copy(xr, xr + e, o);
        }
    return out;
  }
  at::Tensor h = x.slice(2, offset, offset + n * e).view({x.size(0), x.size(1), n, e}).transpose(1, 2);
  if (rotate) return rotary(h, *cos, *sin, half);
  at::Tensor out = at::empty(h.sizes(), h.options());
  out.copy_(h);
  return out;
}

// cache[:, :, start : start + s] = t (t [b, h, s, e]): row copies where both are float32 with contiguous rows of
// the same width, else aten's copy_
void write_rows(at::Tensor& cache, const at::Tensor& t, int64_t start) {
  const int64_t b = t.size(0), h = t.size(1), s = t.size(2), e = t.size(3);
  if (float_last_contiguous(cache) && float_last_contiguous(t) && cache.size(0) == b && cache.size(1) == h &&
      cache.size(3) == e) {
    float* cp = cache.data_ptr<float>();
    const float* tp = t.data_ptr<float>();
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t hi = 0; hi < h; ++hi)
        for (int64_t si = 0; si < s; ++si) {
          const float* src = tp + bi * t.stride(0) + hi * t.stride(1) + si * t.stride(2);
          std::copy(src, src + e, cp + bi * cache.stride(0) + hi * cache.stride(1) + (start + si) * cache.stride(2));
        }
    return;
  }
  cache.slice(2, start, start + s).copy_(t);
}

// One layer's attention on the in-place KV cache (native_glue.fuse_cached_attention): k / v [b, hkv, s, e] written
// at positions k_start / v_start of the caches [b, hkv, capacity, e], then grouped_attention of q [b, hq, s, e] over
// their first start + s positions, returned as [b, s, hq * e] (what the copies, the cache views, the attention and
// its reshape / transpose / reshape compute, in one call)
at::Tensor cached_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                            at::Tensor& v_cache, int64_t k_start, int64_t v_start,
                            const std::optional<at::Tensor>& mask, std::optional<double> scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "picompile_native.cached_attention: 4-D q, k, v and caches expected");
  const int64_t k_end = k_start + k.size(2), v_end = v_start + v.size(2);
  TORCH_CHECK(k_start >= 0 && v_start >= 0 && k_end <= k_cache.size(2) && v_end <= v_cache.size(2),
              "picompile_native.cached_attention: positions ", k_start, "..", k_end, " past the cache's ",
              k_cache.size(2));
  write_rows(k_cache, k, k_start);
  write_rows(v_cache, v, v_start);
  at::Tensor o = grouped_attention(q, k_cache.slice(2, 0, k_end), v_cache.slice(2, 0, v_end), mask, scale);
  if (q.size(2) == 1) return o.reshape({q.size(0), 1, q.size(1) * q.size(3)});  // [b, hq, 1, e] as [b, 1, hq * e]
  return o.transpose(1, 2).reshape({q.size(0), q.size(2), q.size(1) * q.size(3)});
}

}  // namespace

TORCH_LIBRARY(picompile_native, m) {
  m.def("set_kernel(int id, int handle) -> ()", &set_kernel);
  m.def("set_parallel_launch(int address) -> ()", &set_parallel_launch);
  m.def("gemv(Tensor x, Tensor w, Tensor? b, int kernel) -> Tensor");
  m.def("sparse_ffn(Tensor x, Tensor w_up, Tensor? b_up, Tensor? w_gate, Tensor w_down_t, Tensor? mask, int kernel) -> Tensor");
  m.def("qgemv(Tensor x, Tensor w, Tensor s, Tensor? b, int kernel) -> Tensor");
  m.def("qsparse_ffn(Tensor x, Tensor w_up, Tensor s_up, Tensor? b_up, Tensor? w_gate, Tensor? s_gate, Tensor w_down_t, Tensor s_down, Tensor? mask, int kernel) -> Tensor");
  m.def("predict(Tensor x, Tensor fc1, Tensor fc2, Tensor? offset, Tensor thr, int kernel) -> Tensor");
  m.def("input_sparse(Tensor x, Tensor w_t, Tensor? b, Tensor? mask, int kernel) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, int half) -> Tensor");
  m.def("grouped_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float? scale) -> Tensor");
  m.def("heads(Tensor x, int offset, int n, int e, Tensor? cos, Tensor? sin, int half) -> Tensor");
  m.def("cached_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, int k_start, "
        "int v_start, Tensor? mask, float? scale) -> Tensor");
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
  m.impl("heads", &heads);
  m.impl("cached_attention", &cached_attention);
}
