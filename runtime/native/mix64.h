// The hash both native indexes key their open-addressing tables with.
#pragma once

#include <cstdint>

namespace mlc_spec {

// splitmix64's finaliser: a cheap bijection with good avalanche.
inline uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

}  // namespace mlc_spec
