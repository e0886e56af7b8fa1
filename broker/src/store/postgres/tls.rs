//! TLS to PostgreSQL by rustls (the ring provider), checking the server as libpq's `sslmode`
//! says ([`Verify`]): `prefer` and `require` encrypt without checking the certificate (libpq
//! without a root certificate does the same), `verify-ca` checks its chain, `verify-full` its
//! chain and host name. The roots are webpki's, plus the CA file `sslrootcert` names.

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::super::error::StoreError;
use super::location::{Location, Verify};

/// Accepts any certificate, but still checks that the server holds its key (the handshake's
/// signatures): encryption against a passive listener, as libpq's `require` gives.
#[derive(Debug)]
struct Unchecked(WebPkiSupportedAlgorithms);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_schemes()
    }
}

/// Checks the chain to a trusted root but not the name (`verify-ca`): webpki checks the chain
/// first, so a name mismatch is reported only for a chain that holds.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// The TLS connector for `location` (used only when its mode asks for TLS).
pub(super) fn connector(location: &Location) -> Result<MakeRustlsConnect, StoreError> {
    let bad = |detail: String| StoreError::BadLocation {
        location: location.shown.clone(),
        detail,
    };
    // ring, not aws-lc (no C toolchain of its own to build); rustls marks ring's provider
    // deprecated for offering no post-quantum key exchange, which a database link can do without.
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(format!("TLS: {e}")))?;
    let config = match location.verify {
        Verify::Off | Verify::Unchecked => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unchecked(
                provider.signature_verification_algorithms,
            )))
            .with_no_client_auth(),
        Verify::Chain | Verify::Full => {
            let verifier = verifier(location, &provider).map_err(bad)?;
            if location.verify == Verify::Full {
                builder.with_webpki_verifier(verifier).with_no_client_auth()
            } else {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(ChainOnly(verifier)))
                    .with_no_client_auth()
            }
        }
    };
    Ok(MakeRustlsConnect::new(config))
}

/// webpki's verifier over the built-in roots and the `sslrootcert` file's certificates.
fn verifier(
    location: &Location,
    provider: &Arc<CryptoProvider>,
) -> Result<Arc<WebPkiServerVerifier>, String> {
    let mut roots = RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = &location.root_cert {
        let certs = CertificateDer::pem_file_iter(path)
            .map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
        for cert in certs {
            let cert = cert.map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
            roots
                .add(cert)
                .map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
        }
    }
    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::clone(provider))
        .build()
        .map_err(|e| format!("TLS: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mode_builds_a_connector_and_a_missing_root_file_is_a_bad_location() {
        for query in [
            "sslmode=disable",
            "sslmode=prefer",
            "sslmode=require",
            "sslmode=verify-ca",
            "sslmode=verify-full",
        ] {
            let location = Location::parse(&format!("postgres://u@db/f?{query}")).unwrap();
            assert!(connector(&location).is_ok(), "{query}");
        }
        let location =
            Location::parse("postgres://u:hunter2@db/f?sslmode=verify-ca&sslrootcert=/nowhere.pem")
                .unwrap();
        let err = connector(&location).err().expect("a missing file fails");
        assert!(matches!(err, StoreError::BadLocation { .. }), "{err}");
        assert!(err.to_string().contains("/nowhere.pem"), "{err}");
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }
}
