//! Throwaway PKI for one local control plane.
//!
//! One ECDSA P-256 test CA signs the apiserver's serving certificate (SANs `localhost` and
//! `127.0.0.1`: rustls checks the IP SAN) and the client certificates. A client
//! certificate's common name is the user name and its organisations are the groups, which is
//! how kube-apiserver's x509 authenticator reads them. A separate key pair signs
//! service-account tokens. Everything is written as PEM into one directory.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// A client identity: certificate and key as PEM files.
#[derive(Debug, Clone)]
pub struct ClientCert {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The files the control plane and its clients need, and the CA that signs more.
#[derive(Debug)]
pub struct Pki {
    pub ca_cert: PathBuf,
    pub serving_cert: PathBuf,
    pub serving_key: PathBuf,
    pub service_account_key: PathBuf,
    pub service_account_public_key: PathBuf,
    dir: PathBuf,
    ca_params: CertificateParams,
    ca_key: KeyPair,
}

impl Pki {
    /// Creates the CA, the serving pair and the service-account key in `dir`.
    pub fn create(dir: &Path) -> Result<Pki> {
        Pki::create_with_sans(dir, &[], &[])
    }

    /// As [`Pki::create`], with more subject alternative names on the serving certificate
    /// (a real node's Pods reach the API server at the `kubernetes` Service's IP and by its
    /// DNS names, and the node at the bridge address).
    pub fn create_with_sans(dir: &Path, ips: &[IpAddr], names: &[&str]) -> Result<Pki> {
        std::fs::create_dir_all(dir)?;
        let ca_key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name = name("myresource-operator test CA", None);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = params.self_signed(&ca_key)?;
        let service_account = KeyPair::generate()?;
        let pki = Pki {
            ca_cert: write(dir, "ca.crt", &ca_cert.pem())?,
            serving_cert: dir.join("apiserver.crt"),
            serving_key: dir.join("apiserver.key"),
            service_account_key: write(
                dir,
                "service-account.key",
                &service_account.serialize_pem(),
            )?,
            service_account_public_key: write(
                dir,
                "service-account.pub",
                &service_account.public_key_pem(),
            )?,
            dir: dir.to_path_buf(),
            ca_params: params,
            ca_key,
        };

        let mut serving = CertificateParams::new(vec!["localhost".to_string()])?;
        serving
            .subject_alt_names
            .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        for ip in ips {
            serving.subject_alt_names.push(SanType::IpAddress(*ip));
        }
        for name in names {
            serving
                .subject_alt_names
                .push(SanType::DnsName((*name).try_into()?));
        }
        serving.distinguished_name = name("kube-apiserver", None);
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        pki.sign(serving, "apiserver")?;
        Ok(pki)
    }

    /// Issues a client certificate for `user`, in `group` when given, written as
    /// `<file_stem>.crt` and `<file_stem>.key`. (rcgen keeps one value per attribute type, so
    /// a certificate carries at most one group; the tests need no more.)
    pub fn client(&self, file_stem: &str, user: &str, group: Option<&str>) -> Result<ClientCert> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name = name(user, group);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(params, file_stem)
    }

    fn sign(&self, params: CertificateParams, file_stem: &str) -> Result<ClientCert> {
        let issuer = Issuer::from_params(&self.ca_params, &self.ca_key);
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &issuer)?;
        Ok(ClientCert {
            cert: write(&self.dir, &format!("{file_stem}.crt"), &cert.pem())?,
            key: write(&self.dir, &format!("{file_stem}.key"), &key.serialize_pem())?,
        })
    }
}

fn name(common_name: &str, organisation: Option<&str>) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    if let Some(org) = organisation {
        dn.push(DnType::OrganizationName, org);
    }
    dn
}

fn write(dir: &Path, file: &str, contents: &str) -> Result<PathBuf> {
    let path = dir.join(file);
    std::fs::write(&path, contents).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}
