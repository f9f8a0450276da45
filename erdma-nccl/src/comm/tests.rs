use super::*;

#[test]
fn params_round_trip_and_mismatches() {
    let p = Params {
        role: ROLE_SENDER,
        qps: 8,
        notice: NoticeMode::Send,
        nonce: 0xfeed,
    };
    let b = p.encode();
    assert_eq!(b.len(), 16);
    assert_eq!(Params::decode(&b, ROLE_SENDER, 0xfeed, 8).unwrap(), p);
    assert!(
        Params::decode(&b, ROLE_RECEIVER, 0xfeed, 8)
            .unwrap_err()
            .contains("role")
    );
    assert!(
        Params::decode(&b, ROLE_SENDER, 0xbeef, 8)
            .unwrap_err()
            .contains("stale")
    );
    assert!(
        Params::decode(&b, ROLE_SENDER, 0xfeed, 4)
            .unwrap_err()
            .contains("queue pairs")
    );
    assert!(
        Params::decode(b"garbage", ROLE_SENDER, 0xfeed, 8)
            .unwrap_err()
            .contains("foreign")
    );
}

#[test]
fn cm_private_data_names_listen_and_queue_pair() {
    assert!(check_cm_user(&cm_user(5, 3), 5, 3).is_ok());
    assert!(check_cm_user(&cm_user(5, 3), 5, 2).is_err());
    assert!(check_cm_user(&cm_user(6, 3), 5, 3).is_err());
}

#[test]
fn layouts_fit() {
    assert_eq!(record::LEN, SLOTS * RECORD_BYTES + MAX_QPS * 8);
    const { assert!(send_ctrl::LEN < 64 << 10) };
    const { assert!(recv_ctrl::LEN < 64 << 10) };
}
