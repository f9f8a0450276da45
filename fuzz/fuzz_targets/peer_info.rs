//! The SDK's own out-of-band message (`erdma::connect::PeerInfo`): decoding arbitrary bytes never
//! panics, and whatever decodes re-encodes to a message that decodes to the same value.
//!
//! The C tools' out-of-band formats have targets of their own: `oob_rc_pingpong`, `oob_perftest`.

#![no_main]

use erdma::connect::PeerInfo;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(info) = PeerInfo::decode(data) else {
        return;
    };
    let bytes = info.encode().expect("a decoded message re-encodes");
    assert_eq!(PeerInfo::decode(&bytes).ok().as_ref(), Some(&info));
    // The header-then-body path a stream reader takes agrees with the one-shot decode.
    if let Ok(header) = <[u8; 12]>::try_from(&bytes[..12]) {
        let n = PeerInfo::body_len(&header).expect("own header");
        assert_eq!(n, bytes.len() - 12);
        assert_eq!(
            PeerInfo::decode_body(&bytes[12..]).ok().as_ref(),
            Some(&info)
        );
    }
});
