//! Image configs without what an image has not, and roots packed as layers with their modes.

use serde_json::json;

use super::*;
use crate::upstream_images::steps::{link, place};

#[test]
fn configs_leave_out_what_the_image_has_not() {
    let busybox = image::config_of(&[], &["sh"], "", &[]).unwrap();
    let config = busybox["config"].as_object().unwrap();
    assert!(!config.contains_key("Entrypoint") && !config.contains_key("User"));
    assert_eq!(config["Cmd"], json!(["sh"]));
    let coredns = image::config_of(&["/coredns"], &[], "nonroot:nonroot", &["53/udp"]).unwrap();
    assert_eq!(coredns["config"]["User"], "nonroot:nonroot");
    assert_eq!(coredns["config"]["ExposedPorts"], json!({"53/udp": {}}));
}

#[test]
fn trees_become_layers_with_their_modes() {
    let dir = std::env::temp_dir().join(format!("lb-upstream-tree-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    make_dir(&dir, 0o755).unwrap();
    place(&dir, "usr/bin/tool", 0o4755, b"x").unwrap();
    link(&dir, "bin/tool", "/usr/bin/tool").unwrap();
    make_dir(&dir.join("tmp"), 0o1777).unwrap();
    assert!(
        place(&dir, "usr/bin/tool", 0o755, b"y").is_err(),
        "a second file at one path"
    );
    let layer = layer_of_tree(&dir).unwrap();
    fs::remove_dir_all(&dir).unwrap();
    let x = image::sha256_hex(b"x");
    assert_eq!(
        layer.describe(),
        format!(
            "dir /bin 0755\nlink /bin/tool -> /usr/bin/tool\ndir /tmp 1777\ndir /usr 0755\n\
             dir /usr/bin 0755\nfile /usr/bin/tool 4755 1 sha256:{x}\n"
        )
    );
}
