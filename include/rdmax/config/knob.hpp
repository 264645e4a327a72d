#pragma once
// Every RDMAX_* knob is declared once, in a table beside its options struct:
//
//   inline constexpr std::tuple rcache_knobs{
//       config::knob{"RDMAX_RCACHE_ENABLE", &rcache_options::enable, config::flag{},
//                    "0: every get registers, its release deregisters"},
//       ...};
//
// Each entry holds the variable's name, the member it sets (whose initializer
// in the struct is the default), the parser (which also prints the value and
// the accepted range) and a one-line doc. The table drives the struct's
// with_env() (apply_env), validation (a value that does not parse or lies out
// of range throws rdmax::error naming the variable, the value and the range,
// and nothing is applied) and enumeration (describe_env: rdmax-info, the
// README's knob table check). UCX's ucs_config_field_t tables are the model.

#include <array>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include <rdmax/error.hpp>

namespace rdmax::config {

/// How a knob's integer-like member converts to and from the 64-bit number a
/// parser works with: integers as they are, durations as their count.
template <class T>
struct value_traits;

template <std::unsigned_integral T>
    requires(!std::same_as<T, bool>)
struct value_traits<T> {
    static constexpr std::uint64_t max = std::numeric_limits<T>::max();
    static constexpr std::uint64_t to_number(T v) noexcept { return v; }
    static constexpr T from_number(std::uint64_t n) noexcept { return static_cast<T>(n); }
};

template <class Rep, class Period>
struct value_traits<std::chrono::duration<Rep, Period>> {
    using duration = std::chrono::duration<Rep, Period>;
    static constexpr std::uint64_t max =
        static_cast<std::uint64_t>(std::numeric_limits<Rep>::max());
    static constexpr std::uint64_t to_number(duration d) noexcept {
        return d.count() < 0 ? 0 : static_cast<std::uint64_t>(d.count());
    }
    static constexpr duration from_number(std::uint64_t n) noexcept {
        return duration(static_cast<Rep>(n));
    }
};

/// "4096", "16M": a number with an optional binary suffix (K, M, G or T);
/// false when the text is not one or overflows 64 bits.
[[nodiscard]] bool parse_number(std::string_view text, std::uint64_t& out) noexcept;
/// n with the largest binary suffix that divides it ("16M"); 0 and numbers
/// under 1K or not a multiple of one, plain.
[[nodiscard]] std::string format_size(std::uint64_t n);

/// Throws rdmax::error(who, EINVAL): "NAME='value': expected RANGE".
[[noreturn]] void refuse(const char* who, std::string_view name, std::string_view value,
                         std::string_view range);

/// An unsigned number or duration (the count in the unit the name says).
struct number {
    std::uint64_t lo = 0;
    std::uint64_t hi = std::numeric_limits<std::uint64_t>::max(); ///< clamped to the member's
    /// Printed with a binary suffix (a size in bytes); every number parses one.
    bool bytes = false;
    std::uint64_t multiple_of = 1;
    bool power_of_two = false;
    /// A word that stands for 0 ("auto": derived at run time), or empty.
    std::string_view zero_word{};

    template <class T>
    [[nodiscard]] T parse(const char* who, std::string_view name, std::string_view text) const {
        std::uint64_t n = 0;
        if (!zero_word.empty() && text == zero_word)
            return value_traits<T>::from_number(0);
        if (!parse_number(text, n) || !accepts(n, value_traits<T>::max))
            refuse(who, name, text, range<T>());
        return value_traits<T>::from_number(n);
    }
    template <class T>
    [[nodiscard]] std::string format(T v) const {
        const std::uint64_t n = value_traits<T>::to_number(v);
        if (n == 0 && !zero_word.empty())
            return std::string(zero_word);
        return bytes ? format_size(n) : fmt::format("{}", n);
    }
    template <class T>
    [[nodiscard]] std::string range() const {
        return describe_range(value_traits<T>::max);
    }

    [[nodiscard]] bool accepts(std::uint64_t n, std::uint64_t type_max) const noexcept;
    [[nodiscard]] std::string describe_range(std::uint64_t type_max) const;
};

/// A switch: 1, yes, true or 0, no, false.
struct flag {
    template <class T>
        requires std::same_as<T, bool>
    [[nodiscard]] bool parse(const char* who, std::string_view name, std::string_view text) const {
        if (text == "1" || text == "yes" || text == "true")
            return true;
        if (text == "0" || text == "no" || text == "false")
            return false;
        refuse(who, name, text, range<bool>());
    }
    template <class T>
    [[nodiscard]] std::string format(T v) const {
        return v ? "1" : "0";
    }
    template <class T>
    [[nodiscard]] std::string range() const {
        return "0 or 1";
    }
};

/// One word of a choice and the value it names.
template <class E>
struct word {
    std::string_view text;
    E value;
};

/// One of a fixed set of words, each naming a value of E.
template <class E, std::size_t N>
struct choice {
    std::array<word<E>, N> words;

    template <class T>
        requires std::same_as<T, E>
    [[nodiscard]] E parse(const char* who, std::string_view name, std::string_view text) const {
        for (const word<E>& w : words)
            if (w.text == text)
                return w.value;
        refuse(who, name, text, range<E>());
    }
    template <class T>
    [[nodiscard]] std::string format(T v) const {
        for (const word<E>& w : words)
            if (w.value == v)
                return std::string(w.text);
        return "?";
    }
    template <class T>
    [[nodiscard]] std::string range() const {
        std::string out;
        for (std::size_t i = 0; i < N; ++i)
            out += fmt::format("{}{}", i == 0 ? "" : i + 1 == N ? " or " : ", ", words[i].text);
        return out;
    }
};

/// choice<E, N> from a list: one_of<revoke_by>({{"auto", ...}, {"mw", ...}}).
template <class E, std::size_t N>
[[nodiscard]] constexpr choice<E, N> one_of(const word<E> (&words)[N]) {
    choice<E, N> c{};
    for (std::size_t i = 0; i < N; ++i)
        c.words[i] = words[i];
    return c;
}

/// One knob: the variable, the member it sets, how its text is read, and what it does.
template <class Options, class T, class Parser>
struct knob {
    using options_type = Options;
    const char* name;
    T Options::*member;
    Parser parser;
    std::string_view doc;

    void apply(Options& o, std::string_view text, const char* who) const {
        o.*member = parser.template parse<T>(who, name, text);
    }
    [[nodiscard]] std::string format(const Options& o) const {
        return parser.template format<T>(o.*member);
    }
    [[nodiscard]] std::string range() const { return parser.template range<T>(); }
};

template <class Options, class T, class Parser>
knob(const char*, T Options::*, Parser, std::string_view) -> knob<Options, T, Parser>;

/// The variable's value, or empty when it is unset.
[[nodiscard]] inline std::string_view env(const char* name) noexcept {
    const char* v = std::getenv(name);
    return v != nullptr ? std::string_view(v) : std::string_view();
}

/// `o` with every knob of `table` whose variable is set (and not empty)
/// applied. The first value refused throws; `o` is a copy, so the caller's
/// options are never half-applied.
template <class Options, class... Knobs>
[[nodiscard]] Options apply_env(Options o, const std::tuple<Knobs...>& table, const char* who) {
    std::apply(
        [&](const Knobs&... k) {
            const auto one = [&](const auto& kn) {
                if (const std::string_view v = env(kn.name); !v.empty())
                    kn.apply(o, v, who);
            };
            (one(k), ...);
        },
        table);
    return o;
}

/// Where a knob's value came from.
enum class source : std::uint8_t { default_value, environment };

[[nodiscard]] constexpr std::string_view to_string(source s) noexcept {
    return s == source::environment ? "environment" : "default";
}

/// One knob as rdmax-info and the README check see it.
struct knob_row {
    std::string_view name;
    std::string value;         ///< in effect (the environment's, else the default)
    std::string default_value; ///< the struct's member initializer, printed
    std::string range;         ///< what the variable accepts
    std::string_view doc;
    source from = source::default_value;
    std::string problem; ///< the error a set value raises (then value is its text)
};

/// Appends a row per knob of `table`, read against this process's environment.
template <class... Knobs>
void describe_env(const std::tuple<Knobs...>& table, std::vector<knob_row>& out) {
    const auto one = [&out](const auto& k) {
        using options = typename std::remove_cvref_t<decltype(k)>::options_type;
        const options defaults{};
        knob_row row{k.name, k.format(defaults), k.format(defaults), k.range(), k.doc, {}, {}};
        if (const std::string_view v = env(k.name); !v.empty()) {
            row.from = source::environment;
            try {
                options set = defaults;
                k.apply(set, v, "rdmax::config");
                row.value = k.format(set);
            } catch (const rdmax::error& e) {
                row.value = std::string(v);
                row.problem = e.what();
            }
        }
        out.push_back(std::move(row));
    };
    std::apply([&](const Knobs&... k) { (one(k), ...); }, table);
}

} // namespace rdmax::config
