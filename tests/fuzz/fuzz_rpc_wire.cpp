// libFuzzer target for the RPC wire checks (rpc/wire.hpp): whatever a peer
// writes into a slot, and whatever immediate it sends, the checks either
// refuse it or hand back views that lie inside what was written and agree
// with the header. Input: 4 bytes of immediate, 1 byte of geometry, then the
// slot's bytes.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>

#include <rdmax/detail/rpc/wire.hpp>

using namespace rdmax::rpc;

namespace {

void require(bool ok) {
    if (!ok)
        std::abort();
}

bool inside(std::span<const std::byte> part, std::span<const std::byte> whole) {
    return part.data() >= whole.data() && part.data() + part.size() <= whole.data() + whole.size();
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    if (size < 5)
        return 0;
    std::uint32_t imm = 0;
    std::memcpy(&imm, data, 4);
    // Geometry: 1..64 slots of 64 B .. 4 KiB (multiples of 8).
    const std::uint32_t slots = 1U + (data[4] & 0x3fU);
    const std::uint32_t slot_bytes = 64U * (1U + (data[4] >> 6U) * 21U);
    const std::span<const std::byte> written(reinterpret_cast<const std::byte*>(data + 5),
                                             size - 5);

    const imm_fields f = decode_imm(imm);
    require(encode_imm(f.kind, f.slot, f.bytes, f.epoch) == imm);
    for (const message_kind k : {message_kind::request, message_kind::reply}) {
        if (check_imm(f, k, slots, slot_bytes) != violation::none)
            continue;
        // A message the endpoint may read: a slot's bytes within the ring, or
        // a control message (no bytes) with a known code and no epoch.
        if (is_control(f))
            require(f.kind == k && f.slot < control_codes && !f.epoch);
        else
            require(f.kind == k && f.slot < slots && f.bytes >= sizeof(message_header) &&
                    f.bytes <= slot_bytes);
    }

    parsed_request req;
    if (parse_request(written, req) == violation::none) {
        require(written.size() >= sizeof(message_header));
        require(inside(req.inline_body, written));
        require(req.header.method != 0 && req.header.priority <= 7 && req.header.status == 0);
        if (req.external_body) {
            require(req.inline_body.empty());
            require(req.external_body->length == req.header.body_bytes);
            require(req.external_body->addr <= UINT64_MAX - req.external_body->length);
        } else {
            require(req.inline_body.size() == req.header.body_bytes);
        }
        if (req.reply_buffer)
            require(req.reply_buffer->length != 0 &&
                    req.reply_buffer->addr <= UINT64_MAX - req.reply_buffer->length);
        else
            require((req.header.flags & flag_reply_in_buffer) == 0);
    }
    const std::uint32_t offered = imm & 0xfffffU;
    parsed_reply rep;
    if (parse_reply(written, offered, rep) == violation::none) {
        require(inside(rep.inline_body, written));
        require(server_status(rep.header.status) && rep.header.method == 0);
        if ((rep.header.flags & flag_external_reply) != 0)
            require(rep.inline_body.empty() && rep.header.body_bytes <= offered);
        else
            require(rep.inline_body.size() == rep.header.body_bytes);
    }
    // A call that wanted every body in its buffer (a dma-buf): never an inline one.
    if (parse_reply(written, offered, rep, true) == violation::none)
        require(rep.inline_body.empty());
    return 0;
}
