// What metal.h needs from the C++ library in the Metal-language check (MTL_CHECK, parsed by
// libclang with -nostdinc: see metal_emu/check.py). Only declarations and type traits: the
// check never runs anything, and declaring the float overloads alone keeps double out. The
// kernel cannot reach any of it: codegen poisons `std` (and `double`) right after metal.h.
#pragma once

typedef __SIZE_TYPE__ size_t;
typedef __PTRDIFF_TYPE__ ptrdiff_t;
typedef __INT8_TYPE__ int8_t;
typedef __INT16_TYPE__ int16_t;
typedef __INT32_TYPE__ int32_t;
typedef __INT64_TYPE__ int64_t;
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __UINT64_TYPE__ uint64_t;
typedef __UINTPTR_TYPE__ uintptr_t;

namespace std {
template <class T, T v>
struct integral_constant {
  static constexpr T value = v;
  constexpr operator T() const { return v; }
};
typedef integral_constant<bool, true> true_type;
typedef integral_constant<bool, false> false_type;
template <class A, class B>
struct is_same : false_type {};
template <class A>
struct is_same<A, A> : true_type {};
template <bool B, class T = void>
struct enable_if {};
template <class T>
struct enable_if<true, T> {
  typedef T type;
};
template <bool B, class T = void>
using enable_if_t = typename enable_if<B, T>::type;
template <class T> struct remove_cv { typedef T type; };
template <class T> struct remove_cv<const T> { typedef T type; };
template <class T> struct remove_cv<volatile T> { typedef T type; };
template <class T> struct remove_cv<const volatile T> { typedef T type; };
template <class T> struct is_fp_ : false_type {};
template <> struct is_fp_<float> : true_type {};
template <class T>
struct is_floating_point : is_fp_<typename remove_cv<T>::type> {};
template <class T> struct is_int_ : false_type {};
#define MTL_CHECK_INT(T) template <> struct is_int_<T> : true_type {};
MTL_CHECK_INT(bool) MTL_CHECK_INT(char) MTL_CHECK_INT(signed char) MTL_CHECK_INT(unsigned char)
MTL_CHECK_INT(short) MTL_CHECK_INT(unsigned short) MTL_CHECK_INT(int) MTL_CHECK_INT(unsigned)
MTL_CHECK_INT(long) MTL_CHECK_INT(unsigned long) MTL_CHECK_INT(long long)
MTL_CHECK_INT(unsigned long long)
#undef MTL_CHECK_INT
template <class T>
struct is_integral : is_int_<typename remove_cv<T>::type> {};
template <class T>
struct is_arithmetic : integral_constant<bool, is_integral<T>::value || is_floating_point<T>::value> {};

template <class T>
struct numeric_limits {
  static constexpr bool is_specialized = is_integral<T>::value;
  static constexpr bool is_signed = T(-1) < T(0);
  static constexpr bool is_integer = true;
  static constexpr bool has_infinity = false;
  static constexpr int digits = int(sizeof(T) * 8) - (T(-1) < T(0) ? 1 : 0);
  static constexpr T max() { return T((unsigned long long)-1 >> (64 - digits)); }
  static constexpr T min() { return is_signed ? T(-max() - 1) : T(0); }
  static constexpr T lowest() { return min(); }
};
template <>
struct numeric_limits<bool> {
  static constexpr bool is_specialized = true;
  static constexpr bool min() { return false; }
  static constexpr bool max() { return true; }
  static constexpr bool lowest() { return false; }
};
template <>
struct numeric_limits<float> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool has_infinity = true;
  static constexpr int digits = __FLT_MANT_DIG__;
  static constexpr float min() { return __FLT_MIN__; }
  static constexpr float max() { return __FLT_MAX__; }
  static constexpr float lowest() { return -__FLT_MAX__; }
  static constexpr float epsilon() { return __FLT_EPSILON__; }
  static constexpr float infinity() { return __builtin_huge_valf(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
  static constexpr float denorm_min() { return __FLT_DENORM_MIN__; }
};

// <cmath> as metal.h's bodies use it: float overloads only.
#define MTL_CHECK_F1(name) float name(float);
#define MTL_CHECK_F2(name) float name(float, float);
MTL_CHECK_F1(exp) MTL_CHECK_F1(exp2) MTL_CHECK_F1(log) MTL_CHECK_F1(log2) MTL_CHECK_F1(log10)
MTL_CHECK_F1(sqrt) MTL_CHECK_F1(sin) MTL_CHECK_F1(cos) MTL_CHECK_F1(tan) MTL_CHECK_F1(asin)
MTL_CHECK_F1(acos) MTL_CHECK_F1(atan) MTL_CHECK_F1(sinh) MTL_CHECK_F1(cosh) MTL_CHECK_F1(tanh)
MTL_CHECK_F1(floor) MTL_CHECK_F1(ceil) MTL_CHECK_F1(round) MTL_CHECK_F1(nearbyint)
MTL_CHECK_F1(trunc) MTL_CHECK_F1(fabs) MTL_CHECK_F1(erf) MTL_CHECK_F1(log1p) MTL_CHECK_F1(expm1)
MTL_CHECK_F1(cbrt) MTL_CHECK_F1(rint) MTL_CHECK_F1(asinh) MTL_CHECK_F1(acosh) MTL_CHECK_F1(atanh)
MTL_CHECK_F2(pow) MTL_CHECK_F2(atan2) MTL_CHECK_F2(fmod) MTL_CHECK_F2(fmax) MTL_CHECK_F2(fmin)
MTL_CHECK_F2(copysign) MTL_CHECK_F2(hypot) MTL_CHECK_F2(remainder)
#undef MTL_CHECK_F1
#undef MTL_CHECK_F2
float fma(float, float, float);
float ldexp(float, int);
bool isnan(float);
bool isinf(float);
bool isfinite(float);
bool signbit(float);
void* memcpy(void*, const void*, size_t);
void* memset(void*, int, size_t);
}  // namespace std
