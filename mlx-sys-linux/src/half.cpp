// The float16/bfloat16 accessors mlx-c declares only on aarch64, over MLX's own half types (2 bytes each).
#if !defined(__aarch64__)
#include <cstdint>
#include <cstring>
#include <exception>

#include "mlx/c/array.h"
#include "mlx/c/error.h"
#include "mlx/c/private/array.h"

namespace {
template <typename T>
int item_bits(uint16_t* res, mlx_array arr) {
  static_assert(sizeof(T) == 2, "half types are 16-bit");
  try {
    T v = mlx_array_get_(arr).item<T>();
    std::memcpy(res, &v, 2);
    return 0;
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
}

template <typename T>
const uint16_t* data_bits(mlx_array arr) {
  try {
    return reinterpret_cast<const uint16_t*>(mlx_array_get_(arr).data<T>());
  } catch (std::exception& e) {
    mlx_error(e.what());
    return nullptr;
  }
}
}  // namespace

extern "C" int mlx_array_item_float16(uint16_t* res, const mlx_array arr) {
  return item_bits<mlx::core::float16_t>(res, arr);
}
extern "C" int mlx_array_item_bfloat16(uint16_t* res, const mlx_array arr) {
  return item_bits<mlx::core::bfloat16_t>(res, arr);
}
extern "C" const uint16_t* mlx_array_data_float16(const mlx_array arr) {
  return data_bits<mlx::core::float16_t>(arr);
}
extern "C" const uint16_t* mlx_array_data_bfloat16(const mlx_array arr) {
  return data_bits<mlx::core::bfloat16_t>(arr);
}
#endif
