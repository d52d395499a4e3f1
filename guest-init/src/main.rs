//! amvm's PID 1. Reads like a script: mount what the guest needs, open the channel to the VMM,
//! receive the run spec, run the workload, stream its output, report its exit status, reboot.
//!
//! It never exits: PID 1 leaving would panic the kernel. It ends the VM with `reboot(2)`, which
//! the kernel (booted with `reboot=k`) turns into an i8042 reset that the VMM treats as "done".

mod channel;
mod connect;
mod egress;
mod mounts;
mod sandbox;
mod session;
mod sys;
mod workload;

/// Exit status amvm reports when guest-init itself fails.
const EXIT_INIT_FAILURE: u8 = 125;

fn main() {
    // The same binary is the workload's `amvm-connect` tool (see connect.rs).
    let args: Vec<String> = std::env::args().collect();
    if args
        .first()
        .is_some_and(|a| a.rsplit('/').next() == Some("amvm-connect"))
    {
        std::process::exit(connect::main(&args[1..]));
    }
    // Before the channel exists, errors can only go to the kernel console (`amvm run --console`).
    if let Err(e) = mounts::early() {
        eprintln!("guest-init: {e}");
        sys::reboot();
    }
    let mut chan = match channel::Channel::open() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("guest-init: {e}");
            sys::reboot();
        }
    };
    let status = match run(&mut chan) {
        Ok(Some(status)) => status,
        // A session that was told to stop: everything in it has ended.
        Ok(None) => sys::reboot(),
        Err(e) => {
            chan.stderr(format!("amvm: guest-init: {e}\n").as_bytes());
            EXIT_INIT_FAILURE
        }
    };
    chan.exit(status);
    sys::reboot();
}

/// Set the guest up and run the workload (its status), or serve a session until it stops.
fn run(chan: &mut channel::Channel) -> Result<Option<u8>, String> {
    let mut spec = chan.run_spec()?;
    mounts::root(&spec).map_err(|e| format!("building the guest's root: {e}"))?;
    // `lo` on every run, egress or not: a workload's own servers and tests use 127.0.0.1.
    sys::loopback_up().map_err(|e| format!("bringing up the loopback interface: {e}"))?;
    let base_env = spec.env.len();
    if spec.egress {
        let vars = egress::start().map_err(|e| format!("starting the egress relay: {e}"))?;
        spec.env.extend(
            vars.into_iter()
                .map(|(k, v)| format!("{k}={v}").into_bytes()),
        );
    }
    if spec.session {
        let extra = spec.env.split_off(spec.env.len().min(base_env));
        return session::serve(spec.pids_max, extra, spec.root.clone(), chan).map(|()| None);
    }
    workload::run(&spec, chan)
        .map(Some)
        .map_err(|e| e.to_string())
}
