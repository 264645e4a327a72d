#include <cerrno>
#include <string>

#include <rdmax/error.hpp>

namespace rdmax {

namespace {
std::string what_of(std::string_view verb, std::string_view detail) {
    std::string what(verb);
    if (!detail.empty()) {
        what += " (";
        what += detail;
        what += ')';
    }
    return what;
}
} // namespace

error::error(std::string_view verb, int errnum, std::string_view detail)
    : std::system_error(errnum, std::generic_category(), what_of(verb, detail))
    , verb_(verb) {}

void throw_error(std::string_view verb, int errnum, std::string_view detail) {
    // A verb that failed without setting errno still failed: say so rather than "Success".
    throw error(verb, errnum != 0 ? errnum : EIO, detail);
}

} // namespace rdmax
