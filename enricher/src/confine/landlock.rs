//! The Landlock half: handled rights are everything that writes, executes, binds or
//! connects over TCP, and the two scopes; the rules give back only what the plan names.

use landlock::{
    Access, AccessFs, AccessNet, BitFlags, LandlockStatus, NetPort, PathBeneath, PathFd, Ruleset,
    RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope, ABI,
};

use super::{ConfineError, Plan, Report};

/// The ABI these rights were chosen and tested against (Linux 6.15+); a newer kernel's
/// further rights stay unhandled until they are tested here.
const TESTED: ABI = ABI::V7;

/// What the output and spool directories need: files and folders made, written,
/// truncated, renamed (a round's folder moves into place) and removed (retention).
fn writable() -> BitFlags<AccessFs> {
    AccessFs::WriteFile
        | AccessFs::Truncate
        | AccessFs::MakeReg
        | AccessFs::MakeDir
        | AccessFs::RemoveFile
        | AccessFs::RemoveDir
        | AccessFs::Refer
}

pub(super) fn restrict(plan: &Plan) -> Result<Report, ConfineError> {
    let handled = AccessFs::from_write(TESTED) | AccessFs::Execute;
    let mut ruleset = Ruleset::default()
        .handle_access(handled)?
        .handle_access(AccessNet::from_all(TESTED))?
        .scope(Scope::from_all(TESTED))?
        .create()?;
    for dir in &plan.writable {
        let fd = PathFd::new(dir).map_err(|e| ConfineError::Path {
            path: dir.clone(),
            message: e.to_string(),
        })?;
        ruleset = ruleset.add_rule(PathBeneath::new(fd, writable()))?;
    }
    for &port in &plan.connect {
        ruleset = ruleset.add_rule(NetPort::new(port, AccessNet::ConnectTcp))?;
    }
    for &port in &plan.bind {
        ruleset = ruleset.add_rule(NetPort::new(port, AccessNet::BindTcp))?;
    }
    let status = ruleset.restrict_self()?;
    let abi = match status.landlock {
        LandlockStatus::Available { effective_abi, .. } => effective_abi as u64,
        _ => 0,
    };
    let mut missing = Vec::new();
    if status.ruleset == RulesetStatus::NotEnforced || abi == 0 {
        missing.push("Landlock (not built or not enabled: no file, exec, TCP or /proc limits)");
    } else {
        for (since, what) in [
            (2, "renames across folders (ABI 2)"),
            (3, "truncation (ABI 3)"),
            (4, "TCP connect and bind limits (ABI 4)"),
            (5, "device ioctls (ABI 5)"),
            (6, "signal and abstract-socket scopes (ABI 6)"),
        ] {
            if abi < since {
                missing.push(what);
            }
        }
    }
    if !status.no_new_privs {
        missing.push("no_new_privs");
    }
    Ok(Report {
        landlock_abi: abi,
        missing,
    })
}
