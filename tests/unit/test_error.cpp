#include <cerrno>
#include <string>
#include <system_error>

#include <rdmax/error.hpp>
#include <rdmax/status_error.hpp>

#include "../support/catch.hpp"

TEST_CASE("rdmax::error names the verb, the detail and the reason") {
    try {
        rdmax::throw_error("ibv_reg_mr", ENOMEM, "4096 bytes at 0x1000");
        FAIL("throw_error returned");
    } catch (const rdmax::error& e) {
        CHECK(e.verb() == "ibv_reg_mr");
        CHECK(e.code() == std::errc::not_enough_memory);
        const std::string what = e.what();
        CHECK(what.find("ibv_reg_mr") == 0);
        CHECK(what.find("4096 bytes at 0x1000") != std::string::npos);
        CHECK(what.find("Cannot allocate memory") != std::string::npos);
    }
}

TEST_CASE("rdmax::error is a std::system_error") {
    CHECK_THROWS_AS(rdmax::throw_error("ibv_alloc_pd", EPERM), std::system_error);
}

TEST_CASE("a verb that failed without errno is never reported as success") {
    try {
        rdmax::throw_error("ibv_create_qp", 0);
    } catch (const rdmax::error& e) {
        CHECK(e.code().value() != 0);
        CHECK(std::string(e.what()).find("Success") == std::string::npos);
    }
}

TEST_CASE("status_category: an error_code that is no status is never success") {
    // 256 is no status (a status is 8 bits): it must not wrap to ok, whose
    // condition is success, nor take the name of the status it wraps to.
    const std::error_code ec(256, rdmax::status_category());
    CHECK(ec.default_error_condition() != std::error_condition{});
    CHECK(ec.message() == "unknown status");
    const std::error_code neg(-1, rdmax::status_category());
    CHECK(neg.default_error_condition() != std::error_condition{});
    // And the statuses themselves.
    CHECK_FALSE(make_error_code(rdmax::status::ok));
    CHECK(make_error_code(rdmax::status::queue_full) == std::errc::resource_unavailable_try_again);
    CHECK(make_error_code(rdmax::status::zero_length) == std::errc::invalid_argument);
}
