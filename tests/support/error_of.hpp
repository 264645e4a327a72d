#pragma once
// The errno an rdmax::error thrown by `f` carries; 0 when `f` returns.

#include <rdmax/error.hpp>

namespace rdmax::test {

template <class F>
int error_of(F&& f) {
    try {
        f();
    } catch (const rdmax::error& e) {
        return e.code().value();
    }
    return 0;
}

} // namespace rdmax::test
