#include <algorithm>
#include <charconv>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <rdmax/mem/rail_buffer.hpp>
#include <rdmax/verbs/gid.hpp>
#include <rdmax/verbs/rail_options.hpp>

namespace rdmax::verbs {

std::optional<device_port> parse_device_port(std::string_view word) noexcept {
    const std::size_t colon = word.rfind(':');
    if (colon == 0 || colon == std::string_view::npos || colon + 1 == word.size())
        return std::nullopt;
    unsigned port = 0;
    const std::string_view digits = word.substr(colon + 1);
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), port);
    if (ec != std::errc{} || end != digits.data() + digits.size() || port < 1 || port > 255)
        return std::nullopt;
    return device_port{word.substr(0, colon), static_cast<std::uint8_t>(port)};
}

rail_list rail_list_parser::parse_rails(const char* who, std::string_view name,
                                        std::string_view text) {
    const std::string why = "off, auto, or a comma list of addresses and device:port (at most 4)";
    if (text == "off")
        return {};
    if (text == "auto")
        return {rail_list::mode::automatic, {}};
    rail_list out{rail_list::mode::named, {}};
    std::string_view rest = text;
    while (true) {
        const std::size_t comma = rest.find(',');
        const std::string_view word = rest.substr(0, comma);
        if (word.empty() || (!gid::parse(word) && !parse_device_port(word)))
            config::refuse(who, name, text, why + fmt::format(": '{}' is neither", word));
        if (std::find(out.names.begin(), out.names.end(), word) != out.names.end())
            config::refuse(who, name, text, why + fmt::format(": '{}' twice", word));
        out.names.emplace_back(word);
        if (comma == std::string_view::npos)
            break;
        rest.remove_prefix(comma + 1);
    }
    if (out.names.size() > max_rails)
        config::refuse(who, name, text, why);
    return out;
}

std::string rail_list_parser::format_rails(const rail_list& v) {
    switch (v.how) {
    case rail_list::mode::off: return "off";
    case rail_list::mode::automatic: return "auto";
    case rail_list::mode::named: return fmt::format("{}", fmt::join(v.names, ","));
    }
    return "?";
}

rail_options rail_options::with_env() const {
    return config::apply_env(*this, rail_knobs, "rail_options::with_env");
}

} // namespace rdmax::verbs
