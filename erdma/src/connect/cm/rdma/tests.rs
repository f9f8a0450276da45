use super::*;

#[test]
fn socket_addresses_round_trip() {
    for a in ["10.1.2.3:7471", "[fe80::1]:18515", "0.0.0.0:0"] {
        let a: SocketAddr = a.parse().unwrap();
        let (ss, _) = to_sockaddr(a);
        let back = from_sockaddr((&ss as *const libc::sockaddr_storage).cast());
        assert_eq!(back, Some(a));
    }
}
