//! apt's simulation, the names of downloaded packages, and the suites of one release.

use super::*;

#[test]
fn apt_simulation_lists_what_it_installs() {
    let text = "NOTE: This is only a simulation!\n\
                Inst libc6 (2.36-9+deb12u14 Debian:12.15/oldstable [amd64])\n\
                Inst bind9-host (1:9.18.49-1~deb12u3 Debian-Security:12/oldstable-security [amd64])\n\
                Inst libtirpc-common (1.3.3+ds-1 Debian:12.15/oldstable [all])\n\
                Inst curl [7.88.1-10] (7.88.1-10+deb12u15 Debian:12.15/oldstable [amd64])\n\
                Conf libc6 (2.36-9+deb12u14 Debian:12.15/oldstable [amd64])\n";
    let parsed = parse_simulation(text).unwrap();
    let pairs: Vec<(&str, &str)> = parsed.iter().map(|(p, v)| (p.as_str(), v.as_str())).collect();
    assert_eq!(
        pairs,
        [
            ("bind9-host", "1:9.18.49-1~deb12u3"),
            ("curl", "7.88.1-10+deb12u15"),
            ("libc6", "2.36-9+deb12u14"),
            ("libtirpc-common", "1.3.3+ds-1"),
        ]
    );
    assert!(parse_simulation("0 upgraded, 0 newly installed\n").is_err());
    assert!(parse_simulation("Inst broken\n").is_err());
}

#[test]
fn deb_file_names_escape_the_epoch() {
    assert_eq!(
        deb_file_prefix("bind9-host", "1:9.18.49-1~deb12u3"),
        "bind9-host_1%3a9.18.49-1~deb12u3_"
    );
    assert_eq!(deb_file_prefix("curl:amd64", "7.88.1"), "curl_7.88.1_");
}

#[test]
fn suites_are_selected_from_the_sources() {
    let sources = "deb [signed-by=/k.gpg] http://m/debian bookworm main\n\
                   deb [signed-by=/k.gpg] http://m/debian-security bookworm-security main\n\
                   deb [signed-by=/k.gpg] http://m/debian bookworm-backports main\n\
                   deb http://m/debian trixie main\n";
    assert_eq!(
        select_suites(sources, &["bookworm", "bookworm-security"]).unwrap(),
        "deb [signed-by=/k.gpg] http://m/debian bookworm main\n\
         deb [signed-by=/k.gpg] http://m/debian-security bookworm-security main\n"
    );
    assert_eq!(
        select_suites(sources, &["trixie"]).unwrap(),
        "deb http://m/debian trixie main\n"
    );
    assert!(select_suites(sources, &["bookworm", "bookworm-updates"]).is_err());
}
