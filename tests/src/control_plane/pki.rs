//! The control plane's PKI, generated with `rcgen`: a CA, kube-apiserver's serving
//! certificate, an admin client certificate (`O=system:masters`), the service-account key; and
//! the admin kubeconfig. Every file readable by its owner only.

use std::{
    fs::{self, OpenOptions},
    io::Write,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use super::ControlPlane;

impl ControlPlane {
    pub(super) fn write_pki_and_kubeconfig(&self) -> Result<()> {
        let pki = self.dir.path().join("pki");
        fs::create_dir_all(&pki)?;

        let mut ca_params = CertificateParams::default();
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "lb-test-ca");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_key = KeyPair::generate()?;
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let issuer = Issuer::from_params(&ca_params, &ca_key);

        let mut serving = CertificateParams::new(
            [
                "127.0.0.1",
                "10.96.0.1",
                "172.31.255.1",
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ]
            .map(String::from)
            .to_vec(),
        )?;
        serving
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        serving.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        serving.use_authority_key_identifier_extension = true;
        let serving_key = KeyPair::generate()?;
        let serving_cert = serving.signed_by(&serving_key, &issuer)?;

        let mut admin = CertificateParams::default();
        admin.distinguished_name.push(DnType::CommonName, "lb-admin");
        admin
            .distinguished_name
            .push(DnType::OrganizationName, "system:masters");
        admin.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        admin.use_authority_key_identifier_extension = true;
        let admin_key = KeyPair::generate()?;
        let admin_cert = admin.signed_by(&admin_key, &issuer)?;

        // ECDSA P-256 (ES256) service-account token signing key.
        let sa_key = KeyPair::generate()?;

        for (name, contents) in [
            ("ca.crt", ca_cert.pem()),
            ("apiserver.crt", serving_cert.pem()),
            ("apiserver.key", serving_key.serialize_pem()),
            ("admin.crt", admin_cert.pem()),
            ("admin.key", admin_key.serialize_pem()),
            ("sa.key", sa_key.serialize_pem()),
            ("sa.pub", sa_key.public_key_pem()),
        ] {
            write_private(&pki.join(name), contents.as_bytes())?;
        }

        // Strings are JSON-quoted, which YAML reads as plain strings.
        let q = |p: PathBuf| serde_json::to_string(&p.display().to_string()).expect("a string serializes");
        let kubeconfig = format!(
            "apiVersion: v1\n\
             kind: Config\n\
             clusters:\n\
             - name: lb-test\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\n\
             users:\n\
             - name: lb-admin\n  user:\n    client-certificate: {cert}\n    client-key: {key}\n\
             contexts:\n\
             - name: lb-test\n  context:\n    cluster: lb-test\n    user: lb-admin\n    namespace: default\n\
             current-context: lb-test\n",
            server = serde_json::to_string(&self.server_url())?,
            ca = q(self.pki("ca.crt")),
            cert = q(self.pki("admin.crt")),
            key = q(self.pki("admin.key")),
        );
        write_private(&self.kubeconfig, kubeconfig.as_bytes())
    }
}

/// Writes a file readable by its owner only (keys; harmless for the rest).
fn write_private(path: &Path, contents: &[u8]) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(contents)
        .with_context(|| format!("writing {}", path.display()))
}
