//! What every archive shares: image configs (with the images' PATH), the OCI name of this
//! machine's architecture, sha256 digests, and canonical JSON (keys sorted at every level, so
//! the digests do not depend on serde_json's features).

use anyhow::{Result, bail};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::Recipe;

/// PATH in every image's config (Debian's images have the same).
pub(crate) const IMAGE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The image config without rootfs: what the recipe says, plus the platform and PATH.
pub(super) fn image_config(recipe: &Recipe) -> Result<Value> {
    config_of(recipe.entrypoint, recipe.cmd, recipe.user, &[])
}

/// An image config (without rootfs): what a Dockerfile of the image would give, with the usual
/// PATH; no Entrypoint, Cmd, User or ExposedPorts when the image has none.
pub(crate) fn config_of(entrypoint: &[&str], cmd: &[&str], user: &str, ports: &[&str]) -> Result<Value> {
    let mut config = json!({
        "Env": [format!("PATH={IMAGE_PATH}")],
        "WorkingDir": "/",
    });
    if !entrypoint.is_empty() {
        config["Entrypoint"] = json!(entrypoint);
    }
    if !cmd.is_empty() {
        config["Cmd"] = json!(cmd);
    }
    if !user.is_empty() {
        config["User"] = json!(user);
    }
    if !ports.is_empty() {
        config["ExposedPorts"] = Value::Object(ports.iter().map(|p| (p.to_string(), json!({}))).collect());
    }
    Ok(json!({"architecture": arch()?, "os": "linux", "config": config}))
}

/// The OCI architecture of the binaries (built for this machine).
pub(crate) fn arch() -> Result<&'static str> {
    Ok(match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => bail!("no OCI architecture name for {other}"),
    })
}

pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// JSON with object keys sorted at every level and no spaces, whatever serde_json's features
/// (`preserve_order` would keep insertion order): the digests must not depend on them.
pub(super) fn canonical_json(value: &Value) -> String {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            let fields: Vec<String> = keys
                .into_iter()
                .map(|k| format!("{}:{}", Value::from(k.as_str()), canonical_json(&map[k])))
                .collect();
            format!("{{{}}}", fields.join(","))
        }
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(canonical_json).collect();
            format!("[{}]", items.join(","))
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_json_sorts_keys() {
        let v = json!({"b": 1, "a": {"d": [1, "x"], "c": null}});
        assert_eq!(canonical_json(&v), r#"{"a":{"c":null,"d":[1,"x"]},"b":1}"#);
    }
}
