//! `amvm image pull REF`: an image from an OCI distribution registry (the v2 API) into the
//! store, by the oci-client crate (its token dance: anonymous, Basic, or Bearer tokens from the
//! `WWW-Authenticate` challenge; TLS by rustls with the system's roots and `--ca`).
//!
//! The manifest is fetched raw and hashed here (a reference by digest must match it); an
//! index is resolved to its linux/amd64 manifest, fetched by digest and checked the same way;
//! the config and each layer not yet in the store are streamed into a [`BlobWriter`] against
//! their descriptors' digests and sizes, so nothing unchecked is ever under a digest's name and
//! an interrupted pull leaves only files in `tmp/` (`amvm image prune` removes them). Then the
//! image is unpacked and named as an import is.
//!
//! Credentials come from the first of `$REGISTRY_AUTH_FILE`, `$XDG_RUNTIME_DIR/containers/auth.json`
//! (podman's), `$DOCKER_CONFIG/config.json` and `~/.docker/config.json` that has an entry for
//! the registry (`auths.HOST.auth`, base64 of `user:password`, as `podman login` and `docker
//! login` write it).

use super::{bad, normalise, BlobWriter, Digest, Record, Store, StoreError, MAX_CONFIG};
use futures_util::StreamExt;
use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use oci_spec::image::{ImageIndex, ImageManifest};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

/// How to reach the registry.
#[derive(Debug, Clone, Default)]
pub struct PullOptions {
    /// Plain HTTP instead of HTTPS (a registry on loopback without TLS).
    pub plain_http: bool,
    /// PEM certificates to trust besides the system's (a private registry's CA).
    pub ca: Option<PathBuf>,
}

const MEDIA_TYPES: [&str; 4] = [
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];

fn net(what: &str) -> impl FnOnce(oci_client::errors::OciDistributionError) -> StoreError + '_ {
    move |e| bad(what.to_string(), e.to_string())
}

/// Pull `what` (a name as engines take it); its record.
pub fn pull(
    store: &Store,
    what: &str,
    opts: &PullOptions,
    say: &mut dyn FnMut(String),
) -> Result<Record, StoreError> {
    let name = normalise(what)?;
    let reference: Reference = name
        .parse()
        .map_err(|e: oci_client::ParseError| StoreError::BadRef(what.into(), e.to_string()))?;
    // ring, as the gateway's (aws-lc-rs needs cmake and minutes of C on the build machine).
    #[allow(deprecated)]
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut config = ClientConfig::default();
    if let Some(ca) = &opts.ca {
        let data = std::fs::read(ca).map_err(super::io_err(ca.display()))?;
        config.extra_root_certificates.push(Certificate {
            encoding: CertificateEncoding::Pem,
            data,
        });
    }
    let auth = credentials(reference.resolve_registry())?;
    let _lock = store.lock(false)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(super::io_err("a runtime for the pull"))?;
    // As Docker does for a registry on loopback: HTTPS, and plain HTTP when HTTPS cannot even
    // connect (no TLS there).
    let registry = reference.resolve_registry().to_string();
    let protocols = if opts.plain_http {
        vec![ClientProtocol::Http]
    } else if is_loopback(&registry) {
        vec![ClientProtocol::Https, ClientProtocol::Http]
    } else {
        vec![ClientProtocol::Https]
    };
    let mut result = Err(bad(&registry, "not tried"));
    let mut over_https = None;
    for (i, protocol) in protocols.iter().enumerate() {
        let client = Client::new(ClientConfig {
            protocol: protocol.clone(),
            extra_root_certificates: config.extra_root_certificates.clone(),
            ..ClientConfig::default()
        });
        result = rt.block_on(fetch(store, &client, &reference, &auth, &name, say));
        match &result {
            Err(StoreError::Unreachable { why, .. }) if i + 1 < protocols.len() => {
                tracing::debug!("{registry} over HTTPS: {why}; trying plain HTTP");
                over_https = Some(why.clone());
            }
            _ => break,
        }
    }
    // Neither reached the registry (plain HTTP to a TLS port is answered with a 400 saying
    // so): HTTPS's reason is the one to read (a certificate, say). A registry that answered
    // over plain HTTP said what it had to say.
    let plain_failed_too = match &result {
        Err(StoreError::Unreachable { .. }) => true,
        Err(e) => e.to_string().contains("HTTP request to an HTTPS server"),
        Ok(_) => false,
    };
    if let (true, Some(why)) = (plain_failed_too, over_https) {
        result = Err(StoreError::Unreachable {
            registry: registry.clone(),
            why: format!("{why} (and not over plain HTTP either)"),
        });
    }
    let record = result.and_then(|(manifest, config, layers)| {
        let mut recs = store.add(
            std::slice::from_ref(&name),
            &config,
            Some(&manifest),
            &layers,
            &format!("pull {name}"),
            say,
        )?;
        Ok(recs.remove(0))
    });
    if record.is_err() {
        store.undo();
    }
    record
}

/// The manifest's, config's and layers' digests, each blob in the store.
async fn fetch(
    store: &Store,
    client: &Client,
    reference: &Reference,
    auth: &RegistryAuth,
    name: &str,
    say: &mut dyn FnMut(String),
) -> Result<(Digest, Digest, Vec<Digest>), StoreError> {
    let (raw, _) = client
        .pull_manifest_raw(reference, auth, &MEDIA_TYPES)
        .await
        .map_err(|e| first_error(reference, name, e))?;
    let mut digest = Digest::of(&raw);
    if let Some(want) = reference.digest() {
        if digest.as_str() != want {
            return Err(StoreError::DigestMismatch {
                what: format!("the manifest of {name}"),
                want: want.to_string(),
                got: digest.to_string(),
            });
        }
    }
    let mut raw = raw.to_vec();
    if is_index(&raw) {
        let index: ImageIndex = serde_json::from_slice(&raw)
            .map_err(|e| bad(format!("the index of {name}"), e.to_string()))?;
        let pick = super::linux_amd64(&index, name)?;
        let want = Digest::parse(pick.digest().as_ref())
            .map_err(|why| bad(format!("the index of {name}"), why))?;
        let by_digest = reference.clone_with_digest(want.to_string());
        let (m, _) = client
            .pull_manifest_raw(&by_digest, auth, &MEDIA_TYPES)
            .await
            .map_err(net(name))?;
        digest = Digest::of(&m);
        if digest != want || m.len() as u64 != pick.size() {
            return Err(StoreError::DigestMismatch {
                what: format!("the linux/amd64 manifest of {name}"),
                want: want.to_string(),
                got: digest.to_string(),
            });
        }
        raw = m.to_vec();
    }
    if raw.len() as u64 > MAX_CONFIG {
        return Err(bad(format!("the manifest of {name}"), "too large"));
    }
    store.put_blob(
        &format!("the manifest of {name}"),
        &mut raw.as_slice(),
        Some((&digest, raw.len() as u64)),
    )?;
    let manifest: ImageManifest = serde_json::from_slice(&raw)
        .map_err(|e| bad(format!("the manifest of {name}"), e.to_string()))?;
    let config = blob(store, client, reference, manifest.config(), "config", say).await?;
    // The platform is checked before any layer is fetched.
    super::parse_config(&config, &store.read_blob(&config, MAX_CONFIG)?)?;
    let mut layers = Vec::new();
    for l in manifest.layers() {
        layers.push(blob(store, client, reference, l, "layer", say).await?);
    }
    Ok((digest, config, layers))
}

/// The first request's error, said for a user: a registry that cannot be reached (or whose
/// TLS fails) apart from the rest, a refusal with where credentials come from.
fn first_error(
    reference: &Reference,
    name: &str,
    e: oci_client::errors::OciDistributionError,
) -> StoreError {
    use oci_client::errors::OciDistributionError as E;
    match e {
        E::RequestError(e) => StoreError::Unreachable {
            registry: reference.resolve_registry().to_string(),
            why: error_chain(&e),
        },
        E::UnauthorizedError { .. } | E::AuthenticationFailure(_) => bad(
            name.to_string(),
            format!(
                "{e} (credentials come from $REGISTRY_AUTH_FILE, podman login's auth.json or \
                 ~/.docker/config.json)"
            ),
        ),
        e => bad(name.to_string(), e.to_string()),
    }
}

/// An error and its causes on one line (reqwest's own text is only the outermost).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cur = c.source();
    }
    out
}

/// `localhost`, 127.0.0.0/8 or ::1, with or without a port.
fn is_loopback(registry: &str) -> bool {
    let host = match registry.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => registry.split(':').next().unwrap_or(registry),
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn is_index(raw: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Probe {
        #[serde(rename = "mediaType", default)]
        media_type: Option<String>,
        #[serde(default)]
        manifests: Option<serde_json::Value>,
    }
    match serde_json::from_slice::<Probe>(raw) {
        Ok(p) => {
            p.manifests.is_some()
                || p.media_type
                    .as_deref()
                    .is_some_and(|m| m == MEDIA_TYPES[1] || m == MEDIA_TYPES[3])
        }
        Err(_) => false,
    }
}

/// One blob into the store (unless it is there), checked against its descriptor; progress on
/// a terminal.
async fn blob(
    store: &Store,
    client: &Client,
    reference: &Reference,
    d: &oci_spec::image::Descriptor,
    kind: &str,
    say: &mut dyn FnMut(String),
) -> Result<Digest, StoreError> {
    let digest = Digest::parse(d.digest().as_ref())
        .map_err(|why| bad(format!("{kind} of {reference}"), why))?;
    if store.blob(&digest).exists() {
        return Ok(digest);
    }
    let what = format!("{kind} {digest}");
    let desc = OciDescriptor {
        media_type: d.media_type().to_string(),
        digest: digest.to_string(),
        size: d.size() as i64,
        ..Default::default()
    };
    let mut stream = client
        .pull_blob_stream(reference, &desc)
        .await
        .map_err(net(&what))?;
    let mut w = BlobWriter::new(store, &what, Some((&digest, d.size())))?;
    let tty = std::io::stderr().is_terminal();
    let mut shown = std::time::Instant::now();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| bad(what.clone(), e.to_string()))?;
        w.write(&chunk)?;
        if tty && shown.elapsed() > std::time::Duration::from_millis(200) {
            shown = std::time::Instant::now();
            let _ = write!(
                std::io::stderr(),
                "\ramvm: {kind} {}: {} of {}   ",
                digest.short(),
                crate::image::human_size(w.written()),
                crate::image::human_size(d.size())
            );
        }
    }
    let (got, n) = w.finish()?;
    // On a terminal a line per layer stays; otherwise only the summary is said.
    if tty {
        let _ = write!(std::io::stderr(), "\r\x1b[K");
        if kind == "layer" {
            say(format!(
                "{kind} {}: {}",
                got.short(),
                crate::image::human_size(n)
            ));
        }
    }
    Ok(got)
}

/// The credentials for `registry` from the first auth file that has them; anonymous without.
fn credentials(registry: &str) -> Result<RegistryAuth, StoreError> {
    let mut files: Vec<PathBuf> = Vec::new();
    if let Some(f) = std::env::var_os("REGISTRY_AUTH_FILE") {
        files.push(f.into());
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR") {
        files.push(Path::new(&d).join("containers/auth.json"));
    }
    if let Some(d) = std::env::var_os("DOCKER_CONFIG") {
        files.push(Path::new(&d).join("config.json"));
    }
    if let Some(h) = std::env::var_os("HOME") {
        files.push(Path::new(&h).join(".docker/config.json"));
    }
    for f in files {
        let Ok(text) = std::fs::read(&f) else {
            continue;
        };
        if let Some(auth) =
            auth_in(&text, registry).map_err(|why| bad(f.display().to_string(), why))?
        {
            return Ok(auth);
        }
    }
    Ok(RegistryAuth::Anonymous)
}

/// `registry`'s entry in an auth file's `auths`: the keys engines write for it (Docker Hub's
/// under several names).
fn auth_in(text: &[u8], registry: &str) -> Result<Option<RegistryAuth>, String> {
    use base64::Engine as _;
    #[derive(serde::Deserialize)]
    struct File {
        #[serde(default)]
        auths: std::collections::BTreeMap<String, Entry>,
    }
    #[derive(serde::Deserialize)]
    struct Entry {
        #[serde(default)]
        auth: Option<String>,
    }
    let f: File = serde_json::from_slice(text).map_err(|e| e.to_string())?;
    let hub = ["docker.io", "index.docker.io", "registry-1.docker.io"].contains(&registry);
    let entry = f.auths.iter().find(|(k, _)| {
        let k = k
            .trim_start_matches("https://")
            .trim_start_matches("http://");
        let host = k.split('/').next().unwrap_or(k);
        host == registry || (hub && (host == "docker.io" || host == "index.docker.io"))
    });
    let Some((key, Entry { auth: Some(auth) })) = entry else {
        return Ok(None);
    };
    let plain = base64::engine::general_purpose::STANDARD
        .decode(auth.trim())
        .map_err(|_| format!("auths.{key}.auth is not base64"))?;
    let plain = String::from_utf8(plain).map_err(|_| format!("auths.{key}.auth is not text"))?;
    let Some((user, password)) = plain.split_once(':') else {
        return Err(format!("auths.{key}.auth is not user:password"));
    };
    Ok(Some(RegistryAuth::Basic(user.into(), password.into())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auth_files_as_engines_write_them() {
        let f = br#"{"auths": {"127.0.0.1:5443": {"auth": "dXNlcjpwYTpzcw=="},
                    "https://index.docker.io/v1/": {"auth": "aHViOmtleQ=="}}}"#;
        let basic = |u: &str, p: &str| Some(format!("Basic({u:?}, {p:?})"));
        let show = |a: Option<RegistryAuth>| match a {
            Some(RegistryAuth::Basic(u, p)) => Some(format!("Basic({u:?}, {p:?})")),
            Some(other) => Some(format!("{other:?}")),
            None => None,
        };
        assert_eq!(
            show(auth_in(f, "127.0.0.1:5443").unwrap()),
            basic("user", "pa:ss")
        );
        assert_eq!(show(auth_in(f, "docker.io").unwrap()), basic("hub", "key"));
        assert_eq!(show(auth_in(f, "example.com").unwrap()), None);
        assert!(auth_in(br#"{"auths": {"x": {"auth": "!!"}}}"#, "x").is_err());
        assert!(auth_in(b"not json", "x").is_err());
    }

    #[test]
    fn loopback_registries() {
        for r in [
            "localhost:5000",
            "127.0.0.1:5000",
            "127.9.9.9",
            "[::1]:5000",
            "localhost",
        ] {
            assert!(is_loopback(r), "{r}");
        }
        for r in [
            "docker.io",
            "10.0.0.1:5000",
            "localhost.example.com",
            "[::2]:5000",
        ] {
            assert!(!is_loopback(r), "{r}");
        }
    }

    #[test]
    fn indexes_are_told_from_manifests() {
        assert!(is_index(br#"{"schemaVersion":2,"manifests":[]}"#));
        assert!(is_index(
            br#"{"mediaType":"application/vnd.docker.distribution.manifest.list.v2+json"}"#
        ));
        assert!(!is_index(br#"{"schemaVersion":2,"config":{},"layers":[]}"#));
    }
}
