#pragma once
// Parsing of the RDMAX_* environment knobs, shared by the options structs'
// with_env(). Private to src/.

#include <cerrno>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include <rdmax/error.hpp>

namespace rdmax::detail {

/// The variable's value, or empty when unset.
inline std::string_view env(const char* name) noexcept {
    const char* v = std::getenv(name);
    return v != nullptr ? std::string_view(v) : std::string_view();
}

[[noreturn]] inline void malformed(const char* who, const char* name, std::string_view value,
                                   std::string_view expected) {
    throw_error(who, EINVAL, fmt::format("{}='{}': expected {}", name, value, expected));
}

/// "4096", "64K", "16G": a count or size with an optional binary suffix.
inline std::size_t parse_size(const char* who, const char* name, std::string_view text) {
    std::size_t value = 0;
    const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc{} || ptr == text.data())
        malformed(who, name, text, "a number, optionally with K, M, G or T");
    std::string_view suffix(ptr, static_cast<std::size_t>(text.data() + text.size() - ptr));
    unsigned shift = 0;
    if (suffix == "K" || suffix == "k")
        shift = 10;
    else if (suffix == "M" || suffix == "m")
        shift = 20;
    else if (suffix == "G" || suffix == "g")
        shift = 30;
    else if (suffix == "T" || suffix == "t")
        shift = 40;
    else if (!suffix.empty())
        malformed(who, name, text, "a number, optionally with K, M, G or T");
    if (shift != 0 && value > (SIZE_MAX >> shift))
        malformed(who, name, text, "a size that fits in 64 bits");
    return value << shift;
}

/// "1", "yes", "true" or "0", "no", "false".
inline bool parse_flag(const char* who, const char* name, std::string_view v) {
    if (v == "1" || v == "yes" || v == "true")
        return true;
    if (v == "0" || v == "no" || v == "false")
        return false;
    malformed(who, name, v, "0 or 1");
}

/// One of a fixed set of words, each naming a value of T.
template <class T>
struct choice {
    std::string_view word;
    T value;
};

/// The value whose word is v; otherwise an error that lists the words.
template <class T, std::size_t N>
T parse_choice(const char* who, const char* name, std::string_view v,
               const choice<T> (&choices)[N]) {
    for (const choice<T>& c : choices)
        if (v == c.word)
            return c.value;
    std::string words;
    for (std::size_t i = 0; i < N; ++i)
        words += fmt::format("{}{}", i == 0 ? "" : i + 1 == N ? " or " : ", ", choices[i].word);
    malformed(who, name, v, words);
}

} // namespace rdmax::detail
