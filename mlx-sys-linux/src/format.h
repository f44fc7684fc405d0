// Force-included into every mlx-c translation unit. mlx-c formats its error messages with `std::format`,
// which GCC 12's libstdc++ (Debian 12) lacks; mlx-c only ever uses bare "{}" placeholders, so a small
// stand-in that streams each argument into its placeholder is enough. Compilers with <format> skip it.
#pragma once
#ifdef __cplusplus
#include <version>
#if !defined(__cpp_lib_format)
#include <sstream>
#include <string>
#include <string_view>

namespace sluice_format {
inline void put(std::string& out, std::string_view& fmt) {
  out.append(fmt);
  fmt = {};
}

template <typename T, typename... Rest>
void put(std::string& out, std::string_view& fmt, const T& first, const Rest&... rest) {
  auto at = fmt.find("{}");
  if (at == std::string_view::npos) {
    put(out, fmt);
    return;
  }
  out.append(fmt.substr(0, at));
  std::ostringstream os;
  os << first;
  out += os.str();
  fmt.remove_prefix(at + 2);
  put(out, fmt, rest...);
}

template <typename... Args>
std::string format(std::string_view fmt, const Args&... args) {
  std::string out;
  put(out, fmt, args...);
  return out;
}
}  // namespace sluice_format

namespace std {
using ::sluice_format::format;
}
#endif
#endif
