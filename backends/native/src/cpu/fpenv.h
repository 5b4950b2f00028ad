// The host floating-point environment the CPU implementation assumes: IEEE
// subnormals (no flush-to-zero, no denormals-are-zero) and round to nearest
// even. Callers may run with other settings (XLA:CPU's threads flush
// denormals), which would break the bit-exact formats on subnormal values, so
// every CPU entry point runs under this guard, which restores the caller's
// settings on exit.
#ifndef MOE_EP_NATIVE_CPU_FPENV_H_
#define MOE_EP_NATIVE_CPU_FPENV_H_

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#include <xmmintrin.h>
#define MOE_EP_FPENV_X86 1
#endif

namespace moe_ep {
namespace cpu {

class IeeeFpEnv {
 public:
  IeeeFpEnv() {
#if defined(MOE_EP_FPENV_X86)
    saved_ = _mm_getcsr();
    // MXCSR: FTZ bit 15, DAZ bit 6, rounding control bits 13-14 (00 = nearest).
    _mm_setcsr(saved_ & ~(0x8000u | 0x0040u | 0x6000u));
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    // FPCR: FZ bit 24, RMode bits 22-23 (00 = nearest).
    fpcr &= ~((uint64_t{1} << 24) | (uint64_t{3} << 22));
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr));
#endif
  }
  ~IeeeFpEnv() {
#if defined(MOE_EP_FPENV_X86)
    _mm_setcsr(saved_);
#elif defined(__aarch64__)
    uint64_t fpcr = saved_;
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr));
#endif
  }
  IeeeFpEnv(const IeeeFpEnv&) = delete;
  IeeeFpEnv& operator=(const IeeeFpEnv&) = delete;

 private:
#if defined(MOE_EP_FPENV_X86)
  unsigned int saved_ = 0;
#elif defined(__aarch64__)
  uint64_t saved_ = 0;
#endif
};

}  // namespace cpu
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CPU_FPENV_H_
