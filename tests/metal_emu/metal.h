// CPU model of the parts of the Metal Shading Language used by mx.fast.metal_kernel bodies.
//
// Every generated translation unit (see metal_emu/__init__.py) includes this header, then the
// kernel's `header`, then the kernel wrapped the way MLX wraps it, then an entry point
// `mtl_run` that the Python side calls through ctypes.
//
// Execution model (see README in __init__.py docstring):
//   * threadgroups run one after another; inside a group every thread is a fiber (own stack,
//     cooperative switching), started in thread_index_in_threadgroup order;
//   * a fiber runs until it finishes or reaches a synchronisation point: threadgroup_barrier,
//     simdgroup_barrier or any simd_* function. A threadgroup barrier releases when every live
//     thread of the group waits at one; a SIMD-group function when every live lane of its
//     simdgroup (32 lanes, formed from consecutive thread_index_in_threadgroup) has arrived;
//   * `threadgroup T name[N];` declarations are rewritten (by the Python side) into references to
//     per-group arena storage (mtl::tg_var), poisoned with 0xFF bytes (NaN / -1) at group start.
//
// The same header serves the Metal-language check (MTL_CHECK, metal_emu/check.py): libclang,
// real address spaces, no C/C++ library. A built-in added here must parse there too
// (test_metal_check_declares_what_metal_h_models): call metal:: or check_std.h's std:: only,
// spell the address space of pointer parameters (`const device T*`), and take values by value
// (a thread `const T&` cannot bind device memory, as in Metal).
#pragma once

// MTL_CHECK: the Metal-language check (metal_emu/check.py) parses the same translation unit with
// libclang, -fsyntax-only: no C/C++ library (check_std.h declares what the bodies below use),
// no runtime, and real address spaces (see "Address spaces" below).
#if defined(MTL_CHECK)
#include "check_std.h"
#else
#include <cmath>
#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sys/mman.h>
#include <type_traits>
#include <unistd.h>
// Fiber switch: a few lines of x86-64 assembly (no syscalls), ucontext elsewhere or when
// MTL_USE_UCONTEXT is defined (METAL_EMU_CXXFLAGS=-DMTL_USE_UCONTEXT).
#if defined(__x86_64__) && !defined(MTL_USE_UCONTEXT)
#define MTL_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif
#endif  // !MTL_CHECK

// ------------------------------------------------------------------------------------------
// Address spaces: one flat memory under g++ (empty keywords); in the check, clang address
// spaces, so that mixing them is an error as in Metal (thread = clang's default space, as an
// unqualified pointer or reference in Metal is a thread one).
// ------------------------------------------------------------------------------------------
#if defined(MTL_CHECK)
#define device __attribute__((address_space(1)))
#define constant const __attribute__((address_space(2)))  // read-only, as in Metal
#define threadgroup __attribute__((address_space(3)))
#else
#define device
#define constant
#define threadgroup
#endif
#define thread

// ------------------------------------------------------------------------------------------
// Scalar types
// ------------------------------------------------------------------------------------------
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef _Float16 half;
typedef half float16_t;

#if defined(MTL_CHECK)
// The check's bfloat is clang's own: a class would need a member function per address space
// to be read from device memory, which clang's C++ cannot declare (Metal's bfloat is built in).
typedef __bf16 bfloat;
typedef bfloat bfloat16_t;
#else
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  static constexpr bfloat from_bits(uint16_t b) {
    bfloat r{};
    r.bits = b;
    return r;
  }
  static constexpr uint16_t round(float f) {
    uint32_t u = __builtin_bit_cast(uint32_t, f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return uint16_t(u >> 16);
  }
  constexpr bfloat(float f) : bits(round(f)) {}
  constexpr bfloat(double f) : bits(round(float(f))) {}
  constexpr bfloat(half f) : bits(round(float(f))) {}
  constexpr bfloat(int f) : bits(round(float(f))) {}
  constexpr bfloat(uint f) : bits(round(float(f))) {}
  constexpr bfloat(int64_t f) : bits(round(float(f))) {}
  constexpr bfloat(uint64_t f) : bits(round(float(f))) {}
  constexpr bfloat(bool f) : bits(round(float(f))) {}
  constexpr operator float() const { return __builtin_bit_cast(float, uint32_t(bits) << 16); }
  constexpr bfloat operator-() const { return from_bits(uint16_t(bits ^ 0x8000u)); }
  constexpr bfloat operator+() const { return *this; }
#define MTL_BF_ASSIGN(op)                                  \
  template <class U>                                       \
  constexpr bfloat& operator op##=(U o) {                  \
    *this = bfloat(float(*this) op float(o));              \
    return *this;                                          \
  }
  MTL_BF_ASSIGN(+)
  MTL_BF_ASSIGN(-)
  MTL_BF_ASSIGN(*)
  MTL_BF_ASSIGN(/)
#undef MTL_BF_ASSIGN
};
typedef bfloat bfloat16_t;

// bfloat (op) bfloat stays bfloat (rounded); mixing with other types goes through float
// (templates, so that `bf + 1.0f` is not ambiguous with the built-in float operator).
#define MTL_BF_BINOP(op)                                                                    \
  template <class A, class B,                                                               \
            std::enable_if_t<std::is_same<A, bfloat>::value && std::is_same<B, bfloat>::value, \
                             int> = 0>                                                      \
  constexpr inline bfloat operator op(A a, B b) {                                           \
    return bfloat(float(a) op float(b));                                                    \
  }
MTL_BF_BINOP(+)
MTL_BF_BINOP(-)
MTL_BF_BINOP(*)
MTL_BF_BINOP(/)
#undef MTL_BF_BINOP
#endif  // MTL_CHECK
namespace mtl {
constexpr bfloat bf_bits(uint16_t b) { return __builtin_bit_cast(bfloat, b); }
}  // namespace mtl

namespace mtl {
template <class T>
struct is_scalar
    : std::integral_constant<bool, std::is_arithmetic<T>::value || std::is_same<T, half>::value ||
                                       std::is_same<T, bfloat>::value> {};
template <class T>
struct is_float
    : std::integral_constant<bool, std::is_floating_point<T>::value ||
                                       std::is_same<T, half>::value ||
                                       std::is_same<T, bfloat>::value> {};
}  // namespace mtl

// ------------------------------------------------------------------------------------------
// Vector types: vec<T, N> with .x .y .z .w, [] and component-wise arithmetic.
// Size/alignment follow Metal (float3 is 16 bytes, half4 8 bytes, ...).
// ------------------------------------------------------------------------------------------
template <class T, int N>
struct vec;

namespace mtl {
template <class T>
struct ncomp : std::integral_constant<int, 1> {};
template <class T, int N>
struct ncomp<vec<T, N>> : std::integral_constant<int, N> {};
template <class T>
struct is_vec : std::false_type {};
template <class T, int N>
struct is_vec<vec<T, N>> : std::true_type {};

template <class T, class A>
inline void flatten_into(T*& out, const A& a) {
  if constexpr (is_vec<A>::value) {
    for (int i = 0; i < ncomp<A>::value; i++) *out++ = T(a[i]);
  } else {
    *out++ = T(a);
  }
}
}  // namespace mtl

#if defined(MTL_CHECK)
// A vector in device / threadgroup / constant memory is copied (or converted) into a thread one
// through these; clang's C++ cannot declare member functions for other address spaces, so in
// the check such a vector can be loaded and its .x .y .z .w used, not indexed or assigned whole.
#define MTL_VEC_FROM(AS)                                                                     \
  constexpr vec(const AS vec& o) {                                                           \
    for (int i = 0; i < ncomp_; i++) (*this)[i] = (&o.x)[i];                                 \
  }                                                                                          \
  constexpr vec& operator=(const AS vec& o) {                                                \
    for (int i = 0; i < ncomp_; i++) (*this)[i] = (&o.x)[i];                                 \
    return *this;                                                                            \
  }                                                                                          \
  template <class U>                                                                         \
  explicit constexpr vec(const AS vec<U, ncomp_>& o) {                                       \
    for (int i = 0; i < ncomp_; i++) (*this)[i] = T((&o.x)[i]);                              \
  }
#define MTL_VEC_CHECK(N)                                                                     \
  static constexpr int ncomp_ = N;                                                           \
  vec(const vec&) = default;                                                                 \
  vec& operator=(const vec&) = default;                                                      \
  MTL_VEC_FROM(device) MTL_VEC_FROM(threadgroup) MTL_VEC_FROM(constant)
#else
#define MTL_VEC_CHECK(N)
#endif

#define MTL_VEC_COMMON(N)                                                                    \
  vec() = default;                                                                           \
  MTL_VEC_CHECK(N)                                                                           \
  template <class S, std::enable_if_t<mtl::is_scalar<S>::value, int> = 0>                    \
  constexpr vec(S s) {                                                                       \
    for (int i = 0; i < N; i++) (*this)[i] = T(s);                                           \
  }                                                                                          \
  template <class U>                                                                         \
  explicit constexpr vec(const vec<U, N>& o) {                                               \
    for (int i = 0; i < N; i++) (*this)[i] = T(o[i]);                                        \
  }                                                                                          \
  template <class A, class B, class... R,                                                    \
            std::enable_if_t<(mtl::ncomp<A>::value + mtl::ncomp<B>::value +                   \
                              (0 + ... + mtl::ncomp<R>::value)) == N,                        \
                             int> = 0>                                                       \
  constexpr vec(const A& a, const B& b, const R&... r) {                                     \
    T* p = &(*this)[0];                                                                      \
    mtl::flatten_into(p, a);                                                                 \
    mtl::flatten_into(p, b);                                                                 \
    (mtl::flatten_into(p, r), ...);                                                          \
  }                                                                                          \
  constexpr T& operator[](int i) { return (&x)[i]; }                                         \
  constexpr const T& operator[](int i) const { return (&x)[i]; }

template <class T>
struct alignas(sizeof(T) * 2) vec<T, 2> {
  T x, y;
  MTL_VEC_COMMON(2)
};
template <class T>
struct alignas(sizeof(T) * 4) vec<T, 3> {
  T x, y, z;
  MTL_VEC_COMMON(3)
};
template <class T>
struct alignas(sizeof(T) * 4) vec<T, 4> {
  T x, y, z, w;
  MTL_VEC_COMMON(4)
};
#undef MTL_VEC_COMMON

// Operands by value: a vec in another address space converts (check mode, see MTL_VEC_FROM).
#if defined(MTL_CHECK)
#define MTL_VEC_OPASSIGN_AS(op, AS)                                                        \
  template <class T, int N, class B>                                                       \
  AS vec<T, N>& operator op##=(AS vec<T, N>& a, const B& b);
#else
#define MTL_VEC_OPASSIGN_AS(op, AS)
#endif
#define MTL_VEC_BINOP(op)                                                                  \
  template <class T, int N>                                                                \
  constexpr vec<T, N> operator op(vec<T, N> a, vec<T, N> b) {                              \
    vec<T, N> r;                                                                           \
    for (int i = 0; i < N; i++) r[i] = a[i] op b[i];                                       \
    return r;                                                                              \
  }                                                                                        \
  template <class T, int N, class S, std::enable_if_t<mtl::is_scalar<S>::value, int> = 0>  \
  constexpr vec<T, N> operator op(vec<T, N> a, S b) {                                      \
    vec<T, N> r;                                                                           \
    for (int i = 0; i < N; i++) r[i] = a[i] op T(b);                                       \
    return r;                                                                              \
  }                                                                                        \
  template <class T, int N, class S, std::enable_if_t<mtl::is_scalar<S>::value, int> = 0>  \
  constexpr vec<T, N> operator op(S a, vec<T, N> b) {                                      \
    vec<T, N> r;                                                                           \
    for (int i = 0; i < N; i++) r[i] = T(a) op b[i];                                       \
    return r;                                                                              \
  }                                                                                        \
  template <class T, int N, class B>                                                       \
  constexpr vec<T, N>& operator op##=(vec<T, N>& a, const B& b) {                          \
    a = a op b;                                                                            \
    return a;                                                                              \
  }                                                                                        \
  MTL_VEC_OPASSIGN_AS(op, device)                                                          \
  MTL_VEC_OPASSIGN_AS(op, threadgroup)
MTL_VEC_BINOP(+)
MTL_VEC_BINOP(-)
MTL_VEC_BINOP(*)
MTL_VEC_BINOP(/)
MTL_VEC_BINOP(%)
MTL_VEC_BINOP(&)
MTL_VEC_BINOP(|)
MTL_VEC_BINOP(^)
MTL_VEC_BINOP(<<)
MTL_VEC_BINOP(>>)
#undef MTL_VEC_BINOP

#define MTL_VEC_CMP(op)                                                                    \
  template <class T, int N>                                                                \
  constexpr vec<bool, N> operator op(vec<T, N> a, vec<T, N> b) {                           \
    vec<bool, N> r;                                                                        \
    for (int i = 0; i < N; i++) r[i] = a[i] op b[i];                                       \
    return r;                                                                              \
  }
MTL_VEC_CMP(==)
MTL_VEC_CMP(!=)
MTL_VEC_CMP(<)
MTL_VEC_CMP(<=)
MTL_VEC_CMP(>)
MTL_VEC_CMP(>=)
#undef MTL_VEC_CMP

template <class T, int N>
constexpr vec<T, N> operator-(vec<T, N> a) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r[i] = -a[i];
  return r;
}

#define MTL_VEC_ALIASES(T, name)        \
  typedef vec<T, 2> name##2;            \
  typedef vec<T, 3> name##3;            \
  typedef vec<T, 4> name##4;            \
  typedef vec<T, 2> packed_##name##2;   \
  typedef vec<T, 3> packed_##name##3;   \
  typedef vec<T, 4> packed_##name##4;
MTL_VEC_ALIASES(float, float)
MTL_VEC_ALIASES(half, half)
MTL_VEC_ALIASES(bfloat, bfloat)
MTL_VEC_ALIASES(int, int)
MTL_VEC_ALIASES(uint, uint)
MTL_VEC_ALIASES(short, short)
MTL_VEC_ALIASES(ushort, ushort)
MTL_VEC_ALIASES(char, char)
MTL_VEC_ALIASES(uchar, uchar)
MTL_VEC_ALIASES(bool, bool)
#undef MTL_VEC_ALIASES

// ------------------------------------------------------------------------------------------
// Runtime: fibers, scheduler, threadgroup arena, SIMD exchange.
// ------------------------------------------------------------------------------------------
namespace mtl {

struct ThreadInfo {
  uint3 thread_position_in_grid;
  uint3 thread_position_in_threadgroup;
  uint3 threadgroup_position_in_grid;
  uint3 threads_per_threadgroup;
  uint3 dispatch_threads_per_threadgroup;
  uint3 threads_per_grid;
  uint3 grid_size;
  uint3 grid_origin;
  uint3 threadgroups_per_grid;
  uint thread_index_in_threadgroup;
  uint thread_index_in_simdgroup;
  uint simdgroup_index_in_threadgroup;
  uint simdgroups_per_threadgroup;
  uint dispatch_simdgroups_per_threadgroup;
  uint threads_per_simdgroup;
  uint thread_execution_width;
  uint thread_index_in_quadgroup;
  uint quadgroup_index_in_threadgroup;
  uint quadgroups_per_threadgroup;
  uint dispatch_quadgroups_per_threadgroup;
};

typedef void (*EntryFn)(void** args, const ThreadInfo& ti);

enum State { READY = 0, WAIT_TG = 1, WAIT_SIMD = 2, DONE = 3, FAILED = 4 };
enum SimdKind {
  K_BARRIER = 1, K_SUM, K_PRODUCT, K_MAX, K_MIN, K_AND, K_OR, K_XOR, K_SHUFFLE, K_SHUFFLE_DOWN,
  K_SHUFFLE_UP, K_SHUFFLE_XOR, K_ROTATE_DOWN, K_ROTATE_UP, K_BROADCAST, K_BROADCAST_FIRST,
  K_PREFIX_EXCL_SUM, K_PREFIX_INCL_SUM, K_PREFIX_EXCL_PROD, K_PREFIX_INCL_PROD, K_ALL, K_ANY,
  K_IS_FIRST, K_BALLOT
};
inline const char* kind_name(int k) {
  static const char* names[] = {"?", "simdgroup_barrier", "simd_sum", "simd_product", "simd_max",
                                "simd_min", "simd_and", "simd_or", "simd_xor", "simd_shuffle",
                                "simd_shuffle_down", "simd_shuffle_up", "simd_shuffle_xor",
                                "simd_shuffle_rotate_down", "simd_shuffle_rotate_up",
                                "simd_broadcast", "simd_broadcast_first",
                                "simd_prefix_exclusive_sum", "simd_prefix_inclusive_sum",
                                "simd_prefix_exclusive_product",
                                "simd_prefix_inclusive_product", "simd_all", "simd_any",
                                "simd_is_first", "simd_ballot"};
  return (k >= 0 && k <= K_BALLOT) ? names[k] : "?";
}

constexpr int kMaxThreads = 1024;
constexpr int kSimd = 32;
constexpr int kMaxSimd = kMaxThreads / kSimd;
constexpr int kSlotBytes = 64;
constexpr size_t kTgMemLimit = 32768;
constexpr int kMaxTgVars = 256;
constexpr size_t kStackSize = 512 * 1024;
constexpr size_t kGuardBefore = 64 * 1024;   // PROT_NONE bytes before each buffer
constexpr size_t kGuardAfter = 1024 * 1024;  // and after it

#if defined(MTL_CHECK)
// The check never runs a kernel: the runtime is only declared (what the library below calls).
const ThreadInfo& cur_ti();
[[noreturn]] void fail(const char* fmt, ...);
void tg_barrier();
template <class T>
threadgroup T& tg_var(int id);  // threadgroup variables live in the threadgroup address space
template <class T>
int simd_arrive(const T& x, int kind);
template <class T>
T simd_get(int p, int lane);
uint32_t simd_mask(int p);
int run(EntryFn entry, int nbufs, void** host, const uint64_t* nbytes, const int* writeback,
        const char* const* names, const uint32_t* grid3, const uint32_t* tg3, char* errbuf,
        int errlen);
#else
struct Fiber {
  void* sp;
#if !defined(MTL_ASM_SWITCH)
  ucontext_t uc;
#endif
  int state;
  int kind;
  ThreadInfo ti;
};

struct Runtime {
  EntryFn entry;
  void** args;
  Fiber* fibers;
  char* stacks;
  size_t page;
  int nthreads;
  int cur;
  void* sched_sp;
#if !defined(MTL_ASM_SWITCH)
  ucontext_t sched_uc;
#endif
  // threadgroup arena
  alignas(64) unsigned char arena[kTgMemLimit];
  size_t arena_used;
  void* tg_ptr[kMaxTgVars];
  size_t tg_size[kMaxTgVars];
  // SIMD exchange: double-buffered slots per simdgroup
  alignas(64) unsigned char slots[kMaxSimd][2][kSimd][kSlotBytes];
  uint32_t amask[kMaxSimd][2];
  uint32_t sgen[kMaxSimd];
  int simd_live[kMaxSimd];
  int simd_wait[kMaxSimd];
  int live;
  int tg_wait;
  int queue[kMaxThreads];
  int qhead, qtail, qcount;
  // METAL_EMU_SCHEDULE_SEED set: the next ready fiber is drawn at random (xorshift64) instead
  // of in queue order, so work between two sync points runs in another interleaving.
  uint64_t shuffle;
  char err[2048];
  sigjmp_buf jmp;
  volatile sig_atomic_t sig;
  void* sig_addr;
  // buffers (for fault reports)
  int nbufs;
  unsigned char** dev;
  const uint64_t* nbytes;
  const char* const* names;
};

__attribute__((visibility("hidden"))) inline Runtime* R = nullptr;

#if defined(MTL_ASM_SWITCH)
extern "C" __attribute__((visibility("hidden"))) void mtl_ctx_swap(void** save_sp, void* to_sp);
asm(R"(
.pushsection .text
.globl mtl_ctx_swap
.hidden mtl_ctx_swap
.type mtl_ctx_swap,@function
mtl_ctx_swap:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size mtl_ctx_swap, .-mtl_ctx_swap
.popsection
)");
#endif

inline void to_scheduler() {
  Fiber& f = R->fibers[R->cur];
#if defined(MTL_ASM_SWITCH)
  mtl_ctx_swap(&f.sp, R->sched_sp);
#else
  swapcontext(&f.uc, &R->sched_uc);
#endif
  asm volatile("" ::: "memory");
}

[[noreturn]] inline void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(R->err, sizeof(R->err), fmt, ap);
  va_end(ap);
  R->fibers[R->cur].state = FAILED;
  to_scheduler();
  __builtin_unreachable();
}

inline const ThreadInfo& cur_ti() { return R->fibers[R->cur].ti; }

[[noreturn]] inline void fiber_main() {
  Fiber& f = R->fibers[R->cur];
  R->entry(R->args, f.ti);
  R->fibers[R->cur].state = DONE;
  to_scheduler();
  __builtin_unreachable();
}

inline void fiber_init(int i) {
  Fiber& f = R->fibers[i];
  char* top = R->stacks + (size_t)(i + 1) * (kStackSize + R->page);
#if defined(MTL_ASM_SWITCH)
  void** sp = (void**)top;
  *--sp = nullptr;                // fake return address of fiber_main
  *--sp = (void*)&fiber_main;     // popped by `ret` in mtl_ctx_swap
  for (int k = 0; k < 6; k++) *--sp = nullptr;  // rbp rbx r12 r13 r14 r15
  f.sp = sp;
#else
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = top - kStackSize;
  f.uc.uc_stack.ss_size = kStackSize;
  f.uc.uc_link = nullptr;
  makecontext(&f.uc, (void (*)())fiber_main, 0);
#endif
  f.state = READY;
  f.kind = 0;
}

inline void push_ready(int i) {
  R->queue[R->qtail] = i;
  R->qtail = (R->qtail + 1) % kMaxThreads;
  R->qcount++;
}

// ---- threadgroup memory ----
template <class T>
inline T& tg_var(int id) {
  if (id < 0 || id >= kMaxTgVars) fail("too many threadgroup variables");
  if (!R->tg_ptr[id]) {
    size_t align = alignof(T) < 16 ? 16 : alignof(T);
    size_t off = (R->arena_used + align - 1) / align * align;
    if (off + sizeof(T) > kTgMemLimit)
      fail("threadgroup memory exceeds %zu bytes (Metal limit 32 KiB): %zu requested",
           kTgMemLimit, off + sizeof(T));
    R->tg_ptr[id] = R->arena + off;
    std::memset(R->arena + off, 0xff, sizeof(T));  // uninitialised: NaN / -1 pattern
    R->tg_size[id] = sizeof(T);
    R->arena_used = off + sizeof(T);
  }
  return *reinterpret_cast<T*>(R->tg_ptr[id]);
}

// ---- barriers ----
inline void tg_barrier() {
  Fiber& f = R->fibers[R->cur];
  f.state = WAIT_TG;
  to_scheduler();
}

// SIMD exchange: deposit `x`, wait for all live lanes of the simdgroup, return the parity used.
template <class T>
inline int simd_arrive(const T& x, int kind) {
  static_assert(sizeof(T) <= kSlotBytes, "SIMD value too large");
  const ThreadInfo& ti = cur_ti();
  int s = ti.simdgroup_index_in_threadgroup, lane = ti.thread_index_in_simdgroup;
  int p = R->sgen[s] & 1;
  std::memcpy(R->slots[s][p][lane], &x, sizeof(T));
  Fiber& f = R->fibers[R->cur];
  f.state = WAIT_SIMD;
  f.kind = kind;
  to_scheduler();
  return p;
}

template <class T>
inline T simd_get(int p, int lane) {
  int s = cur_ti().simdgroup_index_in_threadgroup;
  T v;
  if (lane < 0 || lane >= kSimd || !((R->amask[s][p] >> lane) & 1u)) {
    std::memset((void*)&v, 0xff, sizeof(T));  // inactive / nonexistent lane: poison
  } else {
    std::memcpy((void*)&v, R->slots[s][p][lane], sizeof(T));
  }
  return v;
}

inline uint32_t simd_mask(int p) { return R->amask[cur_ti().simdgroup_index_in_threadgroup][p]; }

// ---- scheduler ----
inline bool release_simd(int s) {
  if (R->simd_wait[s] == 0 || R->simd_wait[s] != R->simd_live[s]) return true;
  int base = s * kSimd, kind = -1;
  uint32_t mask = 0;
  for (int l = 0; l < kSimd && base + l < R->nthreads; l++) {
    Fiber& f = R->fibers[base + l];
    if (f.state != WAIT_SIMD) continue;
    if (kind < 0) kind = f.kind;
    if (f.kind != kind) {
      snprintf(R->err, sizeof(R->err),
               "divergent SIMD-group functions in simdgroup %d of threadgroup (%u,%u,%u): lane "
               "%d is in %s, another lane in %s (the emulator needs all live lanes of a "
               "simdgroup to call the same SIMD function)",
               s, f.ti.threadgroup_position_in_grid.x, f.ti.threadgroup_position_in_grid.y,
               f.ti.threadgroup_position_in_grid.z, l, kind_name(f.kind), kind_name(kind));
      return false;
    }
    mask |= 1u << l;
  }
  int p = R->sgen[s] & 1;
  R->amask[s][p] = mask;
  R->sgen[s]++;
  R->simd_wait[s] = 0;
  for (int l = 0; l < kSimd; l++)
    if ((mask >> l) & 1u) {
      R->fibers[base + l].state = READY;
      push_ready(base + l);
    }
  return true;
}

inline void release_tg() {
  if (R->tg_wait == 0 || R->tg_wait != R->live) return;
  R->tg_wait = 0;
  for (int i = 0; i < R->nthreads; i++)
    if (R->fibers[i].state == WAIT_TG) {
      R->fibers[i].state = READY;
      push_ready(i);
    }
}

inline void fault_handler(int sig, siginfo_t* info, void*) {
  R->sig = sig;
  R->sig_addr = info ? info->si_addr : nullptr;
  siglongjmp(R->jmp, 1);
}

inline void describe_fault() {
  const ThreadInfo& ti = R->fibers[R->cur].ti;
  char where[1024] = "";
  uintptr_t a = (uintptr_t)R->sig_addr;
  for (int b = 0; b < R->nbufs && R->sig != SIGFPE; b++) {
    uintptr_t lo = (uintptr_t)R->dev[b];
    uintptr_t hi = lo + (R->nbytes[b] + 63) / 64 * 64;
    if (a + kGuardBefore + R->page >= lo && a < hi + kGuardAfter) {
      snprintf(where, sizeof(where), " -> address is %lld bytes from the start of buffer '%s' "
               "(size %llu bytes): out-of-bounds access",
               (long long)((long long)a - (long long)lo), R->names[b],
               (unsigned long long)R->nbytes[b]);
      break;
    }
  }
  if (!where[0] && R->sig != SIGFPE) {
    uintptr_t slo = (uintptr_t)R->stacks + (size_t)R->cur * (kStackSize + R->page);
    if (a >= slo && a < slo + R->page)
      snprintf(where, sizeof(where), " -> thread stack overflow (%zu KiB per thread)",
               kStackSize / 1024);
  }
  snprintf(R->err, sizeof(R->err),
           "%s in thread_position_in_grid=(%u,%u,%u) (threadgroup (%u,%u,%u), "
           "thread_index_in_threadgroup %u) at address %p%s",
           R->sig == SIGSEGV   ? "segmentation fault"
           : R->sig == SIGBUS  ? "bus error"
           : R->sig == SIGFPE  ? "arithmetic exception (integer division by zero?)"
           : R->sig == SIGILL  ? "illegal instruction / trap"
                               : "signal",
           ti.thread_position_in_grid.x, ti.thread_position_in_grid.y,
           ti.thread_position_in_grid.z, ti.threadgroup_position_in_grid.x,
           ti.threadgroup_position_in_grid.y, ti.threadgroup_position_in_grid.z,
           ti.thread_index_in_threadgroup, R->sig_addr, where);
}

inline uint ceil_div(uint a, uint b) { return (a + b - 1) / b; }

// Runs one threadgroup; returns false on error (message in R->err).
inline bool run_group(uint3 gpos, uint3 tgd, uint3 grid, uint3 ngroups) {
  uint3 act{tgd.x, tgd.y, tgd.z};
  uint ox = gpos.x * tgd.x, oy = gpos.y * tgd.y, oz = gpos.z * tgd.z;
  act.x = grid.x - ox < tgd.x ? grid.x - ox : tgd.x;
  act.y = grid.y - oy < tgd.y ? grid.y - oy : tgd.y;
  act.z = grid.z - oz < tgd.z ? grid.z - oz : tgd.z;
  int n = int(act.x * act.y * act.z);
  int nsimd = (n + kSimd - 1) / kSimd;
  uint dispatch_n = tgd.x * tgd.y * tgd.z;
  R->nthreads = n;
  R->live = n;
  R->tg_wait = 0;
  R->qhead = R->qtail = R->qcount = 0;
  R->arena_used = 0;
  std::memset(R->tg_ptr, 0, sizeof(R->tg_ptr));
  for (int s = 0; s < nsimd; s++) {
    R->simd_live[s] = (n - s * kSimd) < kSimd ? (n - s * kSimd) : kSimd;
    R->simd_wait[s] = 0;
    R->sgen[s] = 0;
  }
  for (int i = 0; i < n; i++) {
    uint lx = uint(i) % act.x, ly = (uint(i) / act.x) % act.y, lz = uint(i) / (act.x * act.y);
    ThreadInfo& t = R->fibers[i].ti;
    t.thread_position_in_threadgroup = uint3{lx, ly, lz};
    t.thread_position_in_grid = uint3{ox + lx, oy + ly, oz + lz};
    t.threadgroup_position_in_grid = gpos;
    t.threads_per_threadgroup = act;
    t.dispatch_threads_per_threadgroup = tgd;
    t.threads_per_grid = grid;
    t.grid_size = grid;
    t.grid_origin = uint3{0, 0, 0};
    t.threadgroups_per_grid = ngroups;
    t.thread_index_in_threadgroup = uint(i);
    t.thread_index_in_simdgroup = uint(i) % kSimd;
    t.simdgroup_index_in_threadgroup = uint(i) / kSimd;
    t.simdgroups_per_threadgroup = uint(nsimd);
    t.dispatch_simdgroups_per_threadgroup = ceil_div(dispatch_n, kSimd);
    t.threads_per_simdgroup = kSimd;
    t.thread_execution_width = kSimd;
    t.thread_index_in_quadgroup = uint(i) % 4;
    t.quadgroup_index_in_threadgroup = uint(i) / 4;
    t.quadgroups_per_threadgroup = ceil_div(uint(n), 4);
    t.dispatch_quadgroups_per_threadgroup = ceil_div(dispatch_n, 4);
    fiber_init(i);
    push_ready(i);
  }
  while (R->qcount > 0) {
    if (R->shuffle && R->qcount > 1) {
      R->shuffle ^= R->shuffle << 13;
      R->shuffle ^= R->shuffle >> 7;
      R->shuffle ^= R->shuffle << 17;
      int a = R->qhead, b = int((R->qhead + R->shuffle % uint64_t(R->qcount)) % kMaxThreads);
      int t = R->queue[a];
      R->queue[a] = R->queue[b];
      R->queue[b] = t;
    }
    int i = R->queue[R->qhead];
    R->qhead = (R->qhead + 1) % kMaxThreads;
    R->qcount--;
    R->cur = i;
    Fiber& f = R->fibers[i];
#if defined(MTL_ASM_SWITCH)
    mtl_ctx_swap(&R->sched_sp, f.sp);
#else
    swapcontext(&R->sched_uc, &f.uc);
#endif
    int s = int(f.ti.simdgroup_index_in_threadgroup);
    switch (f.state) {
      case FAILED:
        return false;
      case DONE:
        R->live--;
        R->simd_live[s]--;
        if (!release_simd(s)) return false;
        release_tg();
        break;
      case WAIT_TG:
        R->tg_wait++;
        release_tg();
        break;
      case WAIT_SIMD:
        R->simd_wait[s]++;
        if (!release_simd(s)) return false;
        break;
      default:
        snprintf(R->err, sizeof(R->err), "internal error: fiber state %d", f.state);
        return false;
    }
  }
  if (R->live > 0) {
    int at_tg = 0, at_simd = 0, first_tg = -1, first_simd = -1;
    for (int i = 0; i < n; i++) {
      if (R->fibers[i].state == WAIT_TG) { at_tg++; if (first_tg < 0) first_tg = i; }
      if (R->fibers[i].state == WAIT_SIMD) { at_simd++; if (first_simd < 0) first_simd = i; }
    }
    snprintf(R->err, sizeof(R->err),
             "deadlock in threadgroup (%u,%u,%u): %d live threads, %d waiting at "
             "threadgroup_barrier (first: thread %d), %d waiting in SIMD-group functions "
             "(first: thread %d, %s). Barriers/SIMD functions must be reached by all live "
             "threads of the group/simdgroup (non-uniform control flow?)",
             gpos.x, gpos.y, gpos.z, R->live, at_tg, first_tg, at_simd, first_simd,
             first_simd >= 0 ? kind_name(R->fibers[first_simd].kind) : "-");
    return false;
  }
  return true;
}

// Entry point used by the generated mtl_run. Buffers are copied into guarded allocations
// (PROT_NONE regions right after the exact end and before the start) so that
// out-of-bounds accesses become reported errors instead of silent corruption.
inline int run(EntryFn entry, int nbufs, void** host, const uint64_t* nbytes,
               const int* writeback, const char* const* names, const uint32_t* grid3,
               const uint32_t* tg3, char* errbuf, int errlen) {
  static Runtime* rt_storage = nullptr;
  if (!rt_storage) rt_storage = (Runtime*)std::calloc(1, sizeof(Runtime));
  Runtime* rt = rt_storage;
  R = rt;
  rt->err[0] = 0;
  rt->page = (size_t)sysconf(_SC_PAGESIZE);
  const char* seed = getenv("METAL_EMU_SCHEDULE_SEED");
  rt->shuffle = seed && *seed ? (uint64_t)strtoull(seed, nullptr, 10) * 0x9E3779B97F4A7C15ull + 1 : 0;
  const size_t page = rt->page;
  volatile int rc = 0;
  uint3 grid{grid3[0], grid3[1], grid3[2]};
  uint3 tgd{tg3[0] < grid3[0] ? tg3[0] : grid3[0], tg3[1] < grid3[1] ? tg3[1] : grid3[1],
            tg3[2] < grid3[2] ? tg3[2] : grid3[2]};  // MLX: group dims = min(threadgroup, grid)
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return 0;
  if (tgd.x == 0 || tgd.y == 0 || tgd.z == 0) {
    snprintf(errbuf, errlen, "threadgroup dimensions must be positive");
    return 1;
  }
  size_t tg_n = (size_t)tgd.x * tgd.y * tgd.z;
  if (tg_n > (size_t)kMaxThreads) {
    snprintf(errbuf, errlen,
             "Thread group size (%zu) is greater than the maximum allowed threads per "
             "threadgroup (%d).", tg_n, kMaxThreads);
    return 1;
  }
  // guarded device buffers
  unsigned char** dev = (unsigned char**)std::calloc(nbufs + 1, sizeof(void*));
  void** maps = (void**)std::calloc(nbufs + 1, sizeof(void*));
  size_t* mapsz = (size_t*)std::calloc(nbufs + 1, sizeof(size_t));
  for (int b = 0; b < nbufs; b++) {
    size_t rounded = (nbytes[b] + 63) / 64 * 64;
    if (rounded == 0) rounded = 64;
    size_t body = (rounded + page - 1) / page * page;
    mapsz[b] = kGuardBefore + body + kGuardAfter;
    unsigned char* m = (unsigned char*)mmap(nullptr, mapsz[b], PROT_READ | PROT_WRITE,
                                            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      snprintf(errbuf, errlen, "mmap of %zu bytes failed", mapsz[b]);
      for (int k = 0; k < b; k++) munmap(maps[k], mapsz[k]);
      std::free(dev); std::free(maps); std::free(mapsz);
      return 1;
    }
    maps[b] = m;
    mprotect(m, kGuardBefore, PROT_NONE);
    mprotect(m + kGuardBefore + body, kGuardAfter, PROT_NONE);
    // The buffer ends exactly at the guard: a read one byte past its end faults (MLX's own
    // buffers may have slack there, but a kernel must not rely on it).
    dev[b] = m + kGuardBefore + body - nbytes[b];
    std::memset(m + kGuardBefore, 0xa5, body);
    std::memcpy(dev[b], host[b], nbytes[b]);
  }
  rt->nbufs = nbufs;
  rt->dev = dev;
  rt->nbytes = nbytes;
  rt->names = names;
  // fiber stacks, each with a guard page below
  size_t nthreads_max = tg_n;
  size_t stack_total = nthreads_max * (kStackSize + page);
  rt->stacks = (char*)mmap(nullptr, stack_total, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  for (size_t i = 0; i < nthreads_max; i++)
    mprotect(rt->stacks + i * (kStackSize + page), page, PROT_NONE);
  rt->fibers = (Fiber*)std::calloc(nthreads_max, sizeof(Fiber));
  rt->entry = entry;
  rt->args = (void**)dev;

  // fault handlers on an alternate stack
  stack_t ss{}, old_ss{};
  ss.ss_sp = std::malloc(1 << 16);
  ss.ss_size = 1 << 16;
  sigaltstack(&ss, &old_ss);
  struct sigaction sa{}, old[4];
  const int sigs[4] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
  sa.sa_sigaction = fault_handler;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  for (int k = 0; k < 4; k++) sigaction(sigs[k], &sa, &old[k]);

  uint3 ngroups{ceil_div(grid.x, tgd.x), ceil_div(grid.y, tgd.y), ceil_div(grid.z, tgd.z)};
  rt->cur = 0;
  if (sigsetjmp(rt->jmp, 1) == 0) {
    for (uint gz = 0; gz < ngroups.z && rc == 0; gz++)
      for (uint gy = 0; gy < ngroups.y && rc == 0; gy++)
        for (uint gx = 0; gx < ngroups.x && rc == 0; gx++)
          if (!run_group(uint3{gx, gy, gz}, tgd, grid, ngroups)) rc = 2;
  } else {
    describe_fault();
    rc = 3;
  }
  for (int k = 0; k < 4; k++) sigaction(sigs[k], &old[k], nullptr);
  sigaltstack(&old_ss, nullptr);
  std::free(ss.ss_sp);

  if (rc == 0) {
    for (int b = 0; b < nbufs && rc == 0; b++) {
      unsigned char* m = (unsigned char*)maps[b] + kGuardBefore;
      size_t body = mapsz[b] - kGuardBefore - kGuardAfter;
      for (unsigned char* p = m; p < m + body; p++) {
        if (p >= dev[b] && p < dev[b] + nbytes[b]) {
          p = dev[b] + nbytes[b] - 1;
          continue;
        }
        if (*p != 0xa5) {
          snprintf(rt->err, sizeof(rt->err),
                   "out-of-bounds write to buffer '%s' at byte offset %lld (size %llu bytes)",
                   names[b], (long long)(p - dev[b]), (unsigned long long)nbytes[b]);
          rc = 4;
          break;
        }
      }
    }
  }
  if (rc == 0)
    for (int b = 0; b < nbufs; b++)
      if (writeback[b]) std::memcpy(host[b], dev[b], nbytes[b]);
  if (rc != 0) snprintf(errbuf, errlen, "%s", rt->err);
  for (int b = 0; b < nbufs; b++) munmap(maps[b], mapsz[b]);
  munmap(rt->stacks, stack_total);
  std::free(rt->fibers);
  std::free(dev);
  std::free(maps);
  std::free(mapsz);
  R = nullptr;
  return rc;
}

#endif  // MTL_CHECK

}  // namespace mtl

// ------------------------------------------------------------------------------------------
// Metal library: synchronisation, SIMD-group functions, math, misc.
// ------------------------------------------------------------------------------------------
namespace metal {

enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2,
                              mem_texture = 4, mem_threadgroup_imageblock = 8,
                              mem_object_data = 16 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint(a) | uint(b)); }

inline void threadgroup_barrier(mem_flags = mem_flags::mem_none) { mtl::tg_barrier(); }
inline void simdgroup_barrier(mem_flags = mem_flags::mem_none) {
  mtl::simd_arrive(0, mtl::K_BARRIER);
}

// max/min/clamp: one overload per scalar type (floats follow fmax/fmin: NaN ignored).
#define MTL_MINMAX(T)                                                              \
  inline T max(T a, T b) {                                                         \
    if constexpr (mtl::is_float<T>::value) return T(std::fmax(float(a), float(b))); \
    else return a > b ? a : b;                                                     \
  }                                                                                \
  inline T min(T a, T b) {                                                         \
    if constexpr (mtl::is_float<T>::value) return T(std::fmin(float(a), float(b))); \
    else return a < b ? a : b;                                                     \
  }                                                                                \
  inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
MTL_MINMAX(float)
MTL_MINMAX(half)
MTL_MINMAX(bfloat)
MTL_MINMAX(char)
MTL_MINMAX(int8_t)
MTL_MINMAX(uchar)
MTL_MINMAX(short)
MTL_MINMAX(ushort)
MTL_MINMAX(int)
MTL_MINMAX(uint)
MTL_MINMAX(int64_t)
MTL_MINMAX(uint64_t)
#undef MTL_MINMAX
template <class T, int N>
inline vec<T, N> max(vec<T, N> a, vec<T, N> b) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r[i] = max(a[i], b[i]);
  return r;
}
template <class T, int N>
inline vec<T, N> min(vec<T, N> a, vec<T, N> b) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r[i] = min(a[i], b[i]);
  return r;
}
template <class T, int N>
inline vec<T, N> clamp(vec<T, N> x, vec<T, N> lo, vec<T, N> hi) {
  return min(max(x, lo), hi);
}
namespace fast {
using metal::max;
using metal::min;
}
namespace precise {
using metal::max;
using metal::min;
}

// ---- SIMD-group functions (active lanes = live lanes of the simdgroup) ----
namespace detail {
template <class T, class Op>
inline T simd_reduce(T x, int kind, Op op) {
  int p = mtl::simd_arrive(x, kind);
  uint32_t m = mtl::simd_mask(p);
  T vals[32];
  int n = 0;
  for (int l = 0; l < 32; l++)
    if ((m >> l) & 1u) vals[n++] = mtl::simd_get<T>(p, l);
  // pairwise (tree) reduction in lane order, like a butterfly on full simdgroups
  while (n > 1) {
    int h = 0;
    for (int i = 0; i + 1 < n; i += 2) vals[h++] = op(vals[i], vals[i + 1]);
    if (n & 1) vals[h++] = vals[n - 1];
    n = h;
  }
  return vals[0];
}
template <class T, class Op>
inline T simd_scan(T x, int kind, bool inclusive, T identity, Op op) {
  int p = mtl::simd_arrive(x, kind);
  uint32_t m = mtl::simd_mask(p);
  int me = int(mtl::cur_ti().thread_index_in_simdgroup);
  T acc = identity;
  for (int l = 0; l < me + (inclusive ? 1 : 0); l++)
    if ((m >> l) & 1u) acc = op(acc, mtl::simd_get<T>(p, l));
  return acc;
}
template <class T>
inline T simd_from(T x, int kind, int src, bool keep_if_out) {
  int p = mtl::simd_arrive(x, kind);
  if (src < 0 || src >= 32) return keep_if_out ? x : mtl::simd_get<T>(p, -1);
  return mtl::simd_get<T>(p, src);
}
inline int lane() { return int(mtl::cur_ti().thread_index_in_simdgroup); }
}  // namespace detail

template <class T>
inline T simd_sum(T x) {
  return detail::simd_reduce(x, mtl::K_SUM, [](T a, T b) { return T(a + b); });
}
template <class T>
inline T simd_product(T x) {
  return detail::simd_reduce(x, mtl::K_PRODUCT, [](T a, T b) { return T(a * b); });
}
template <class T>
inline T simd_max(T x) {
  return detail::simd_reduce(x, mtl::K_MAX, [](T a, T b) { return metal::max(a, b); });
}
template <class T>
inline T simd_min(T x) {
  return detail::simd_reduce(x, mtl::K_MIN, [](T a, T b) { return metal::min(a, b); });
}
template <class T>
inline T simd_and(T x) {
  return detail::simd_reduce(x, mtl::K_AND, [](T a, T b) { return T(a & b); });
}
template <class T>
inline T simd_or(T x) {
  return detail::simd_reduce(x, mtl::K_OR, [](T a, T b) { return T(a | b); });
}
template <class T>
inline T simd_xor(T x) {
  return detail::simd_reduce(x, mtl::K_XOR, [](T a, T b) { return T(a ^ b); });
}
template <class T>
inline T simd_prefix_exclusive_sum(T x) {
  return detail::simd_scan(x, mtl::K_PREFIX_EXCL_SUM, false, T(0),
                           [](T a, T b) { return T(a + b); });
}
template <class T>
inline T simd_prefix_inclusive_sum(T x) {
  return detail::simd_scan(x, mtl::K_PREFIX_INCL_SUM, true, T(0),
                           [](T a, T b) { return T(a + b); });
}
template <class T>
inline T simd_prefix_exclusive_product(T x) {
  return detail::simd_scan(x, mtl::K_PREFIX_EXCL_PROD, false, T(1),
                           [](T a, T b) { return T(a * b); });
}
template <class T>
inline T simd_prefix_inclusive_product(T x) {
  return detail::simd_scan(x, mtl::K_PREFIX_INCL_PROD, true, T(1),
                           [](T a, T b) { return T(a * b); });
}
template <class T>
inline T simd_shuffle(T x, ushort src) {
  return detail::simd_from(x, mtl::K_SHUFFLE, int(src), false);
}
template <class T>
inline T simd_broadcast(T x, ushort src) {
  return detail::simd_from(x, mtl::K_BROADCAST, int(src), false);
}
template <class T>
inline T simd_shuffle_down(T x, ushort delta) {
  return detail::simd_from(x, mtl::K_SHUFFLE_DOWN, detail::lane() + int(delta), true);
}
template <class T>
inline T simd_shuffle_up(T x, ushort delta) {
  return detail::simd_from(x, mtl::K_SHUFFLE_UP, detail::lane() - int(delta), true);
}
template <class T>
inline T simd_shuffle_xor(T x, ushort mask) {
  return detail::simd_from(x, mtl::K_SHUFFLE_XOR, detail::lane() ^ int(mask & 31), false);
}
template <class T>
inline T simd_shuffle_rotate_down(T x, ushort delta) {
  return detail::simd_from(x, mtl::K_ROTATE_DOWN, (detail::lane() + int(delta)) & 31, false);
}
template <class T>
inline T simd_shuffle_rotate_up(T x, ushort delta) {
  return detail::simd_from(x, mtl::K_ROTATE_UP, (detail::lane() - int(delta)) & 31, false);
}
template <class T>
inline T simd_broadcast_first(T x) {
  int p = mtl::simd_arrive(x, mtl::K_BROADCAST_FIRST);
  uint32_t m = mtl::simd_mask(p);
  return mtl::simd_get<T>(p, __builtin_ctz(m));
}
inline bool simd_all(bool x) {
  int p = mtl::simd_arrive(x, mtl::K_ALL);
  uint32_t m = mtl::simd_mask(p);
  for (int l = 0; l < 32; l++)
    if (((m >> l) & 1u) && !mtl::simd_get<bool>(p, l)) return false;
  return true;
}
inline bool simd_any(bool x) {
  int p = mtl::simd_arrive(x, mtl::K_ANY);
  uint32_t m = mtl::simd_mask(p);
  for (int l = 0; l < 32; l++)
    if (((m >> l) & 1u) && mtl::simd_get<bool>(p, l)) return true;
  return false;
}
struct simd_vote {
  uint64_t v;
  explicit operator uint64_t() const { return v; }
  bool all() const { return false; }
  bool any() const { return v != 0; }
};
inline simd_vote simd_ballot(bool x) {
  int p = mtl::simd_arrive(x, mtl::K_BALLOT);
  uint32_t m = mtl::simd_mask(p);
  uint64_t r = 0;
  for (int l = 0; l < 32; l++)
    if (((m >> l) & 1u) && mtl::simd_get<bool>(p, l)) r |= uint64_t(1) << l;
  return simd_vote{r};
}
inline bool simd_is_first() {
  int p = mtl::simd_arrive(0, mtl::K_IS_FIRST);
  return int(__builtin_ctz(mtl::simd_mask(p))) == detail::lane();
}

// ---- numeric limits ----
template <class T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static constexpr half max() { return half(65504.0f); }
  static constexpr half min() { return half(6.103515625e-05f); }
  static constexpr half lowest() { return half(-65504.0f); }
  static constexpr half epsilon() { return half(0.0009765625f); }
  static constexpr half infinity() { return half(__builtin_inff()); }
  static constexpr half quiet_NaN() { return half(__builtin_nanf("")); }
  static constexpr half denorm_min() { return half(5.960464477539063e-08f); }
  static constexpr bool has_infinity = true;
};
template <>
struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static constexpr bfloat max() { return mtl::bf_bits(0x7f7f); }
  static constexpr bfloat min() { return mtl::bf_bits(0x0080); }
  static constexpr bfloat lowest() { return mtl::bf_bits(0xff7f); }
  static constexpr bfloat epsilon() { return mtl::bf_bits(0x3c00); }
  static constexpr bfloat infinity() { return mtl::bf_bits(0x7f80); }
  static constexpr bfloat quiet_NaN() { return mtl::bf_bits(0x7fc0); }
  static constexpr bfloat denorm_min() { return mtl::bf_bits(0x0001); }
  static constexpr bool has_infinity = true;
};

// ---- math: scalar templates for float/half/bfloat (computed in float for half/bfloat) ----
template <class T>
using if_float = std::enable_if_t<mtl::is_float<T>::value, int>;
template <class T>
using if_scalar = std::enable_if_t<mtl::is_scalar<T>::value, int>;

// Non-template overloads per type (like Metal's library), so that overload resolution and
// implicit conversions behave as in Metal: exp(half) -> half, max(float, int) -> float, ...
#define MTL_UNARY_T(name, expr, T)                                                 \
  inline T name(T v) {                                                             \
    float x = float(v);                                                            \
    return T(expr);                                                                \
  }
#define MTL_UNARY(name, expr)                                                      \
  MTL_UNARY_T(name, expr, float)                                                   \
  MTL_UNARY_T(name, expr, half)                                                    \
  MTL_UNARY_T(name, expr, bfloat)                                                  \
  template <class T, int N>                                                        \
  inline vec<T, N> name(vec<T, N> v) {                                             \
    vec<T, N> r;                                                                   \
    for (int i = 0; i < N; i++) r[i] = name(v[i]);                                 \
    return r;                                                                      \
  }
#define MTL_UNARY_ALL(name, expr) \
  MTL_UNARY(name, expr)           \
  namespace fast {                \
  MTL_UNARY(name, expr)           \
  }                               \
  namespace precise {             \
  MTL_UNARY(name, expr)           \
  }

MTL_UNARY_ALL(exp, std::exp(x))
MTL_UNARY_ALL(exp2, std::exp2(x))
MTL_UNARY_ALL(exp10, std::pow(10.0f, x))
MTL_UNARY_ALL(log, std::log(x))
MTL_UNARY_ALL(log2, std::log2(x))
MTL_UNARY_ALL(log10, std::log10(x))
MTL_UNARY_ALL(sqrt, std::sqrt(x))
MTL_UNARY_ALL(rsqrt, 1.0f / std::sqrt(x))
MTL_UNARY_ALL(sin, std::sin(x))
MTL_UNARY_ALL(cos, std::cos(x))
MTL_UNARY_ALL(tan, std::tan(x))
MTL_UNARY_ALL(asin, std::asin(x))
MTL_UNARY_ALL(acos, std::acos(x))
MTL_UNARY_ALL(atan, std::atan(x))
MTL_UNARY_ALL(sinh, std::sinh(x))
MTL_UNARY_ALL(cosh, std::cosh(x))
MTL_UNARY_ALL(tanh, std::tanh(x))
MTL_UNARY_ALL(floor, std::floor(x))
MTL_UNARY_ALL(ceil, std::ceil(x))
MTL_UNARY_ALL(round, std::round(x))
MTL_UNARY_ALL(rint, std::nearbyint(x))
MTL_UNARY_ALL(trunc, std::trunc(x))
MTL_UNARY_ALL(fabs, std::fabs(x))
MTL_UNARY_ALL(fract, x - std::floor(x))
MTL_UNARY_ALL(erf, std::erf(x))
MTL_UNARY_ALL(log1p, std::log1p(x))
MTL_UNARY_ALL(expm1, std::expm1(x))
MTL_UNARY_ALL(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x == x ? 0.0f : x)))
#undef MTL_UNARY_ALL
#undef MTL_UNARY
#undef MTL_UNARY_T

#define MTL_BINARY_T(name, expr, T)                                                \
  inline T name(T va, T vb) {                                                      \
    float a = float(va), b = float(vb);                                            \
    return T(expr);                                                                \
  }
#define MTL_BINARY(name, expr)                                                     \
  MTL_BINARY_T(name, expr, float)                                                  \
  MTL_BINARY_T(name, expr, half)                                                   \
  MTL_BINARY_T(name, expr, bfloat)                                                 \
  template <class T, int N>                                                        \
  inline vec<T, N> name(vec<T, N> a, vec<T, N> b) {                                \
    vec<T, N> r;                                                                   \
    for (int i = 0; i < N; i++) r[i] = name(a[i], b[i]);                           \
    return r;                                                                      \
  }
#define MTL_BINARY_ALL(name, expr) \
  MTL_BINARY(name, expr)           \
  namespace fast {                 \
  MTL_BINARY(name, expr)           \
  }                                \
  namespace precise {              \
  MTL_BINARY(name, expr)           \
  }
MTL_BINARY_ALL(pow, std::pow(a, b))
MTL_BINARY_ALL(powr, std::pow(a, b))
MTL_BINARY_ALL(atan2, std::atan2(a, b))
MTL_BINARY_ALL(fmod, std::fmod(a, b))
MTL_BINARY_ALL(fmax, std::fmax(a, b))
MTL_BINARY_ALL(fmin, std::fmin(a, b))
MTL_BINARY_ALL(copysign, std::copysign(a, b))
MTL_BINARY_ALL(divide, a / b)
#undef MTL_BINARY_ALL
#undef MTL_BINARY
#undef MTL_BINARY_T

template <class T>
inline T saturate(T x) {
  return metal::clamp(x, T(0), T(1));
}
template <class T>
inline T abs(T a) {
  if constexpr (mtl::is_vec<T>::value) {
    T r;
    for (int i = 0; i < mtl::ncomp<T>::value; i++) r[i] = metal::abs(a[i]);
    return r;
  } else if constexpr (mtl::is_float<T>::value) {
    return T(std::fabs(float(a)));
  } else {
    return a < T(0) ? T(-a) : a;
  }
}
template <class T>
inline T fma(T a, T b, T c) {
  if constexpr (mtl::is_vec<T>::value) {
    T r;
    for (int i = 0; i < mtl::ncomp<T>::value; i++) r[i] = metal::fma(a[i], b[i], c[i]);
    return r;
  } else if constexpr (std::is_same<T, float>::value) {
    return std::fma(a, b, c);
  } else {
    return T(std::fma(float(a), float(b), float(c)));
  }
}
template <class T>
inline T mix(T x, T y, T a) {
  return x + (y - x) * a;
}
template <class T, class C>
inline T select(T a, T b, C c) {
  if constexpr (mtl::is_vec<T>::value && mtl::is_vec<C>::value) {
    T r;
    for (int i = 0; i < mtl::ncomp<T>::value; i++) r[i] = c[i] ? b[i] : a[i];
    return r;
  } else {
    return c ? b : a;
  }
}
template <class T, if_float<T> = 0>
inline bool isnan(T x) {
  return std::isnan(float(x));
}
template <class T, if_float<T> = 0>
inline bool isinf(T x) {
  return std::isinf(float(x));
}
template <class T, if_float<T> = 0>
inline bool isfinite(T x) {
  return std::isfinite(float(x));
}
template <class T, if_float<T> = 0>
inline bool signbit(T x) {
  return std::signbit(float(x));
}
template <class T, int N>
inline T dot(vec<T, N> a, vec<T, N> b) {
  T s = T(0);
  for (int i = 0; i < N; i++) s += a[i] * b[i];
  return s;
}
template <class T, int N>
inline bool all(vec<T, N> a) {
  for (int i = 0; i < N; i++)
    if (!a[i]) return false;
  return true;
}
template <class T, int N>
inline bool any(vec<T, N> a) {
  for (int i = 0; i < N; i++)
    if (a[i]) return true;
  return false;
}
inline bool all(bool a) { return a; }
inline bool any(bool a) { return a; }
template <class T>
inline T popcount(T x) {
  return T(__builtin_popcountll((unsigned long long)x));
}
template <class T>
inline T clz(T x) {
  return x == 0 ? T(sizeof(T) * 8)
                : T(__builtin_clzll((unsigned long long)x) - (64 - int(sizeof(T)) * 8));
}
template <class T>
inline T ctz(T x) {
  return x == 0 ? T(sizeof(T) * 8) : T(__builtin_ctzll((unsigned long long)x));
}

template <class To, class From>
inline To as_type(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
#if defined(MTL_CHECK)  // vec is not trivially copyable there (its copies from other spaces)
  return *(const To*)&x;
#else
  return __builtin_bit_cast(To, x);
#endif
}

// ---- atomics (threads run one at a time, so plain loads/stores are atomic) ----
enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release,
                    memory_order_acq_rel, memory_order_seq_cst };
template <class T>
struct atomic {
  T v;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
#if defined(MTL_CHECK)
// Metal's atomic functions take device or threadgroup atomics (no thread ones); declarations.
#define MTL_ATOMIC_DECLS(AS)                                                                   \
  template <class T, class U>                                                                  \
  void atomic_store_explicit(volatile AS atomic<T>* o, U v, memory_order);                     \
  template <class T>                                                                           \
  T atomic_load_explicit(const volatile AS atomic<T>* o, memory_order);                        \
  template <class T, class U>                                                                  \
  T atomic_exchange_explicit(volatile AS atomic<T>* o, U v, memory_order);                     \
  template <class T, class U>                                                                  \
  bool atomic_compare_exchange_weak_explicit(volatile AS atomic<T>* o, thread T* expected,     \
                                             U desired, memory_order, memory_order);           \
  MTL_ATOMIC_RMW_DECL(AS, add) MTL_ATOMIC_RMW_DECL(AS, sub) MTL_ATOMIC_RMW_DECL(AS, and)       \
  MTL_ATOMIC_RMW_DECL(AS, or) MTL_ATOMIC_RMW_DECL(AS, xor) MTL_ATOMIC_RMW_DECL(AS, max)        \
  MTL_ATOMIC_RMW_DECL(AS, min)
#define MTL_ATOMIC_RMW_DECL(AS, name)                                                          \
  template <class T, class U>                                                                  \
  T atomic_fetch_##name##_explicit(volatile AS atomic<T>* o, U u, memory_order);
MTL_ATOMIC_DECLS(device)
MTL_ATOMIC_DECLS(threadgroup)
#undef MTL_ATOMIC_RMW_DECL
#undef MTL_ATOMIC_DECLS
#else
template <class T, class U>
inline void atomic_store_explicit(atomic<T>* o, U v, memory_order) { o->v = T(v); }
template <class T>
inline T atomic_load_explicit(const atomic<T>* o, memory_order) { return o->v; }
template <class T, class U>
inline T atomic_exchange_explicit(atomic<T>* o, U v, memory_order) {
  T old = o->v;
  o->v = T(v);
  return old;
}
#define MTL_ATOMIC_RMW(name, expr)                                    \
  template <class T, class U>                                         \
  inline T atomic_fetch_##name##_explicit(atomic<T>* o, U u, memory_order) { \
    T old = o->v, v = T(u);                                           \
    o->v = (expr);                                                    \
    return old;                                                       \
  }
MTL_ATOMIC_RMW(add, T(old + v))
MTL_ATOMIC_RMW(sub, T(old - v))
MTL_ATOMIC_RMW(and, T(old & v))
MTL_ATOMIC_RMW(or, T(old | v))
MTL_ATOMIC_RMW(xor, T(old ^ v))
MTL_ATOMIC_RMW(max, metal::max(old, v))
MTL_ATOMIC_RMW(min, metal::min(old, v))
#undef MTL_ATOMIC_RMW
template <class T, class U>
inline bool atomic_compare_exchange_weak_explicit(atomic<T>* o, T* expected, U desired,
                                                  memory_order, memory_order) {
  if (o->v == *expected) {
    o->v = T(desired);
    return true;
  }
  *expected = o->v;
  return false;
}
#endif  // MTL_CHECK

}  // namespace metal

using namespace metal;

// ---- bits of MLX's metal::utils() that custom kernels commonly use ----
template <typename U>
struct Limits {
  static constexpr U max = metal::numeric_limits<U>::max();
  static constexpr U min = metal::numeric_limits<U>::min();
  static constexpr U finite_max = metal::numeric_limits<U>::max();
  static constexpr U finite_min = metal::numeric_limits<U>::min();
};
#define MTL_FLOAT_LIMIT(type)                                                          \
  template <>                                                                          \
  struct Limits<type> {                                                                \
    static constexpr type max = metal::numeric_limits<type>::infinity();               \
    static constexpr type min = -metal::numeric_limits<type>::infinity();              \
    static constexpr type finite_max = metal::numeric_limits<type>::max();             \
    static constexpr type finite_min = -metal::numeric_limits<type>::max();            \
  };
MTL_FLOAT_LIMIT(float)
MTL_FLOAT_LIMIT(half)
MTL_FLOAT_LIMIT(bfloat)
#undef MTL_FLOAT_LIMIT
template <>
struct Limits<bool> {
  static constexpr bool max = true;
  static constexpr bool min = false;
};

template <typename IdxT = int64_t>
inline IdxT elem_to_loc(IdxT elem, constant const int* shape, constant const int64_t* strides,
                        int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += (elem % shape[i]) * IdxT(strides[i]);
    elem /= shape[i];
  }
  return loc;
}
inline uint16_t bfloat16_to_uint16(const bfloat16_t x) { return __builtin_bit_cast(uint16_t, x); }
inline bfloat16_t uint16_to_bfloat16(const uint16_t x) { return mtl::bf_bits(x); }

// ---- Metal keywords and attributes ----
#define METAL_FUNC inline
#define ray_data
#define object_data
#define kernel
