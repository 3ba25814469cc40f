//! The TCP rendezvous store on 127.0.0.1, with ranks as threads. Every test finishes
//! in well under a second: timeouts are a few hundred milliseconds.

use std::collections::HashMap;
use std::net::TcpListener;
use std::time::{Duration, Instant};

use tessera_collectives::{RendezvousEnv, Store, StoreServer};
use tessera_core::Error;

const LONG: Duration = Duration::from_secs(10);

/// A port nothing listens on (bound, then released).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn state_msg(e: &Error) -> &str {
    match e {
        Error::State { msg, .. } => msg,
        other => panic!("expected Error::State, got {other:?}"),
    }
}

#[test]
fn set_get_add_wait_and_barrier_between_thread_ranks() {
    const WORLD: usize = 4;
    let store0 = Store::serve("127.0.0.1:0", WORLD, LONG).unwrap();
    assert!(store0.is_server());
    let addr = store0.addr().to_string();
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    let rank = |store: &Store| {
        let r = store.rank();
        store.wait_for_all_ranks().unwrap();
        // A counter every rank adds to; the values are distinct per rank.
        let v = store.add("counter", 1).unwrap();
        assert!((1..=WORLD as i64).contains(&v), "{v}");
        store.set(&format!("value/{r}"), &[r as u8; 3]).unwrap();
        let keys: Vec<String> = (0..WORLD).map(|i| format!("value/{i}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        store.wait(&refs, LONG).unwrap();
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(store.get(k).unwrap(), vec![i as u8; 3]);
        }
        assert_eq!(store.check(&["value/0", "nope"]).unwrap(), [true, false]);
        store.barrier("after-values").unwrap();
        // Everyone has added by now.
        assert_eq!(store.add("counter", 0).unwrap(), WORLD as i64);
        // A get blocks until some rank (rank 0, below) sets the key later.
        assert_eq!(store.get("late").unwrap(), b"news");
        store.barrier("end").unwrap();
    };
    std::thread::scope(|s| {
        for r in 1..WORLD {
            let addr = addr.clone();
            s.spawn(move || {
                let store = Store::connect(&addr, r, WORLD, LONG).unwrap();
                assert!(!store.is_server());
                rank(&store);
            });
        }
        // A second connection: requests on one `Store` are serialized, so a blocked
        // get would hold up a set sent through the same client.
        let addr = addr.clone();
        s.spawn(move || {
            let other = Store::connect(&addr, 0, WORLD, LONG).unwrap();
            std::thread::sleep(Duration::from_millis(30));
            other.set("late", b"news").unwrap();
        });
        rank(&store0);
    });
    // Namespaces count per store.
    assert_eq!(store0.next_namespace("g"), "g/0");
    assert_eq!(store0.next_namespace("g"), "g/1");
}

#[test]
fn a_get_that_times_out_is_a_typed_error() {
    let store = Store::serve("127.0.0.1:0", 1, LONG).unwrap();
    let start = Instant::now();
    let e = store
        .get_timeout("missing", Duration::from_millis(100))
        .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(2));
    let msg = state_msg(&e);
    assert!(
        msg.contains("key `missing` was not set within 100ms"),
        "{msg}"
    );
    let e = store
        .wait(&["a", "b"], Duration::from_millis(50))
        .unwrap_err();
    assert!(state_msg(&e).contains(r#"["a", "b"]"#), "{e}");
    // The connection is still usable after a timeout.
    store.set("missing", b"x").unwrap();
    assert_eq!(store.get("missing").unwrap(), b"x");
}

#[test]
fn a_rank_that_never_arrives_is_named() {
    const WORLD: usize = 4;
    let timeout = Duration::from_millis(300);
    let store0 = Store::serve("127.0.0.1:0", WORLD, timeout).unwrap();
    let addr = store0.addr().to_string();
    let start = Instant::now();
    // Ranks 0, 1, 2 come; rank 3 never does.
    let errors = std::thread::scope(|s| {
        let others: Vec<_> = (1..3)
            .map(|r| {
                let addr = addr.clone();
                s.spawn(move || {
                    let store = Store::connect(&addr, r, WORLD, timeout).unwrap();
                    store.wait_for_all_ranks().unwrap_err()
                })
            })
            .collect();
        let mut errors = vec![store0.wait_for_all_ranks().unwrap_err()];
        errors.extend(others.into_iter().map(|h| h.join().unwrap()));
        errors
    });
    assert!(start.elapsed() < Duration::from_secs(2));
    for e in errors {
        assert_eq!(
            state_msg(&e),
            format!("rank 3 of 4 did not reach the store at {addr} within 300ms"),
        );
    }
}

#[test]
fn a_server_that_never_appears_is_a_typed_error() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let start = Instant::now();
    let e = Store::connect(&addr, 1, 2, Duration::from_millis(200)).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(2));
    let msg = state_msg(&e);
    assert!(
        msg.starts_with(&format!(
            "rank 1 of 2 did not reach the store at {addr} within 200ms: "
        )),
        "{msg}"
    );
}

#[test]
fn a_client_waits_for_a_server_that_starts_late() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    std::thread::scope(|s| {
        let client = s.spawn(|| {
            let store = Store::connect(&addr, 1, 2, LONG).unwrap();
            store.get("k").unwrap()
        });
        std::thread::sleep(Duration::from_millis(50));
        let server = StoreServer::bind(("127.0.0.1", port)).unwrap();
        assert_eq!(server.local_addr().port(), port);
        let store0 = Store::connect(&addr, 0, 2, LONG).unwrap();
        store0.set("k", b"v").unwrap();
        assert_eq!(client.join().unwrap(), b"v");
        server.shutdown();
    });
}

#[test]
fn the_server_going_away_is_an_error_not_a_hang() {
    let store0 = Store::serve("127.0.0.1:0", 2, LONG).unwrap();
    let store1 = Store::connect(store0.addr(), 1, 2, LONG).unwrap();
    let start = Instant::now();
    std::thread::scope(|s| {
        let waiting = s.spawn(|| store1.get("never").unwrap_err());
        std::thread::sleep(Duration::from_millis(50));
        drop(store0);
        let e = waiting.join().unwrap();
        assert!(state_msg(&e).contains("the store server went away"), "{e}");
    });
    assert!(start.elapsed() < Duration::from_secs(2));
    // Later requests fail too, at once.
    assert!(store1.set("k", b"v").is_err());
}

#[test]
fn bad_requests_and_ports_in_use_are_typed_errors() {
    let store = Store::serve("127.0.0.1:0", 1, LONG).unwrap();
    store.set("text", b"not a number").unwrap();
    let e = store.add("text", 1).unwrap_err();
    assert!(state_msg(&e).contains("not an integer counter"), "{e}");
    // The server is still fine.
    assert_eq!(store.add("n", 5).unwrap(), 5);
    assert_eq!(store.get("n").unwrap(), b"5");
    let e = StoreServer::bind(store.addr()).unwrap_err();
    assert!(state_msg(&e).contains("could not listen"), "{e}");
    let e = Store::connect(store.addr(), 2, 2, LONG).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
}

fn env_of(pairs: &[(&str, &str)]) -> Result<RendezvousEnv, Error> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    RendezvousEnv::from_lookup(|k| map.get(k).cloned())
}

#[test]
fn environment_errors_name_the_variable() {
    let full = [
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    let env = env_of(&full).unwrap();
    assert_eq!(
        env,
        RendezvousEnv {
            rank: 1,
            world_size: 4,
            local_rank: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
        }
    );
    assert_eq!(env.master(), "127.0.0.1:29500");
    let with = |k: &str, v: Option<&str>| -> String {
        let pairs: Vec<(&str, &str)> = full
            .iter()
            .filter(|(n, _)| *n != k)
            .copied()
            .chain(v.map(|v| (k, v)))
            .collect();
        let e = env_of(&pairs).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        e.to_string()
    };
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        let msg = with(var, None);
        assert!(msg.contains(&format!("{var} is not set")), "{msg}");
    }
    assert!(with("RANK", Some("x")).contains(r#"RANK="x" is not a non-negative integer"#));
    assert!(with("LOCAL_RANK", Some("-1")).contains("LOCAL_RANK=\"-1\""));
    assert!(with("MASTER_PORT", Some("70000")).contains("MASTER_PORT=\"70000\" is not a port"));
    assert!(with("RANK", Some("4")).contains("RANK=4 is not below WORLD_SIZE=4"));
    assert!(with("WORLD_SIZE", Some("0")).contains("WORLD_SIZE=0"));
    assert!(with("MASTER_ADDR", Some(" ")).contains("MASTER_ADDR is empty"));
    let v6 = RendezvousEnv {
        master_addr: "::1".into(),
        ..env
    };
    assert_eq!(v6.master(), "[::1]:29500");
}

#[test]
fn ranks_meet_through_the_environment_convention() {
    const WORLD: usize = 3;
    let port = free_port();
    let env = |rank| RendezvousEnv {
        rank,
        world_size: WORLD,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    };
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORLD)
            .rev() // rank 0 last: the others retry until its server is up
            .map(|r| {
                let env = env(r);
                s.spawn(move || {
                    let store = Store::from_rendezvous(&env, LONG).unwrap();
                    assert_eq!(store.is_server(), r == 0);
                    assert_eq!(store.addr(), format!("127.0.0.1:{port}"));
                    store.set(&format!("hello/{r}"), b"hi").unwrap();
                    let keys: Vec<String> = (0..WORLD).map(|i| format!("hello/{i}")).collect();
                    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                    store.wait(&refs, LONG).unwrap();
                    store.barrier("done").unwrap();
                    // Rank 0 hosts the server: it is dropped only after every rank
                    // is done with it (below).
                    store
                })
            })
            .collect();
        let stores: Vec<Store> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        drop(stores);
    });
}
