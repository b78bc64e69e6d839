//! The fork flags on the command line, generated from the fork table
//! ([`crate::engine::forks::FORKS`]): [`ForkArgs`] adds `--l1/--l2/--l3` and one flag per fork
//! to any subcommand through `#[command(flatten)]`, and `mlxb flags` prints what a
//! combination resolves to (or the README table with `--markdown`).

use crate::engine::forks::{self, Domain, Forks, KvQuant, Resolution, Tier, FORKS};
use clap::builder::PossibleValuesParser;
use clap::{Arg, ArgAction, ArgGroup, ArgMatches, Args, Command, FromArgMatches};

/// The tier alias and the explicitly given fork flags, as parsed.
#[derive(Debug, Clone, Default)]
pub struct ForkArgs {
    /// `--l1`, `--l2` or `--l3` (none = `--l1`).
    pub tier: Option<Tier>,
    /// `(fork name, value)` for every fork flag given, in table order.
    pub explicit: Vec<(String, String)>,
    /// `--kv-config FILE`: optiq's per-layer KV allocation for `--kv-quant config`.
    pub kv_config: Option<std::path::PathBuf>,
}

const HEADING: &str = "Forks and parity tiers (see `mlxb flags`)";

fn fork_arg(f: &'static forks::Fork) -> Arg {
    let defaults = Tier::ALL
        .iter()
        .map(|t| format!("{t}: {}", f.default_in(*t)))
        .collect::<Vec<_>>()
        .join(", ");
    let arg = Arg::new(f.name)
        .long(f.name)
        .value_name(match &f.domain {
            Domain::Choices(c) if c.iter().all(|c| ["on", "off"].contains(&c.value)) => "on|off",
            Domain::Choices(_) => "VALUE",
            Domain::Count => "N",
        })
        .action(ArgAction::Set)
        .help_heading(HEADING)
        .help(format!("{} [{defaults}]", f.help));
    match &f.domain {
        Domain::Choices(c) => {
            arg.value_parser(PossibleValuesParser::new(c.iter().map(|c| c.value)))
        }
        Domain::Count => arg.value_parser(move |s: &str| {
            f.check(s).map(|_| s.to_owned()).map_err(|e| e.to_string())
        }),
    }
}

fn augment(cmd: Command) -> Command {
    let mut cmd = cmd;
    for t in Tier::ALL {
        cmd = cmd.arg(
            Arg::new(t.flag())
                .long(t.flag())
                .action(ArgAction::SetTrue)
                .help_heading(HEADING)
                .help(format!(
                    "Tier {t}: set every fork to its {t} default (explicit fork flags override); parity with {}",
                    t.oracle()
                )),
        );
    }
    cmd = cmd.group(
        ArgGroup::new("tier")
            .args(Tier::ALL.map(Tier::flag))
            .multiple(false),
    );
    for f in FORKS {
        cmd = cmd.arg(fork_arg(f));
    }
    cmd.arg(
        Arg::new("kv-config")
            .long("kv-config")
            .value_name("FILE")
            .value_parser(clap::value_parser!(std::path::PathBuf))
            .help_heading(HEADING)
            .help("mlx-optiq's per-layer KV allocation (kv_config.json) for --kv-quant config (default: the one beside the model, else config.json's kv_quantization)"),
    )
}

impl FromArgMatches for ForkArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut s = Self::default();
        s.update_from_arg_matches(m)?;
        Ok(s)
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        for t in Tier::ALL {
            if m.get_flag(t.flag()) {
                self.tier = Some(t);
            }
        }
        for f in FORKS {
            if let Some(v) = m.get_one::<String>(f.name) {
                self.explicit.retain(|(n, _)| n != f.name);
                self.explicit.push((f.name.to_owned(), v.clone()));
            }
        }
        if let Some(p) = m.get_one::<std::path::PathBuf>("kv-config") {
            self.kv_config = Some(p.clone());
        }
        Ok(())
    }
}

impl Args for ForkArgs {
    fn augment_args(cmd: Command) -> Command {
        augment(cmd)
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        augment(cmd)
    }
}

impl ForkArgs {
    /// Resolves the tier and the explicit flags against the table.
    pub fn resolve(&self) -> crate::engine::error::Result<Resolution> {
        forks::resolve(self.tier, &self.explicit)
    }

    /// Resolves and prints the documented warnings to stderr (what the commands run with).
    pub fn forks(&self) -> anyhow::Result<Forks> {
        let r = self.resolve()?;
        for w in &r.warnings {
            eprintln!("mlxb: warning: {w}");
        }
        Ok(r.forks)
    }
}

/// Flags of `mlxb flags`.
#[derive(Debug, Args)]
pub struct FlagsArgs {
    #[command(flatten)]
    pub forks: ForkArgs,
    /// Print one JSON object instead of the text report.
    #[arg(long)]
    pub json: bool,
    /// Print the README flag table (Markdown), generated from the fork table.
    #[arg(long, conflicts_with = "json")]
    pub markdown: bool,
    /// Also open this model (a directory or built-in name) and say where `--kv-quant config`
    /// finds its per-layer KV settings.
    #[arg(long, conflicts_with = "markdown")]
    pub model: Option<String>,
}

/// Where `--kv-quant config` finds per-layer KV settings for the model in `dir`, or why it
/// finds none.
fn kv_source(dir: &std::path::Path, args: &ForkArgs) -> anyhow::Result<String> {
    let forks = args.resolve()?.forks;
    let mut loaded = crate::engine::models::load(dir, forks)?;
    if let Some(path) = &args.kv_config {
        loaded.use_kv_config(path)?;
    }
    Ok(match (forks.kv_quant, &loaded.plan.kv_source) {
        (KvQuant::Config, Some(source)) => source.clone(),
        (KvQuant::Config, None) => loaded
            .plan
            .warnings
            .iter()
            .find(|w| w.starts_with("--kv-quant config:"))
            .cloned()
            .unwrap_or_else(|| "no per-layer KV settings".into()),
        _ => "not read: only --kv-quant config (the --l2 and --l3 default) uses them".into(),
    })
}

/// Entry point of `mlxb flags`.
pub fn run(args: FlagsArgs) -> anyhow::Result<()> {
    if args.markdown {
        print!("{}", forks::markdown_table());
        return Ok(());
    }
    let r = args.forks.resolve()?;
    let source = match &args.model {
        Some(m) => Some(kv_source(
            &super::common::resolve_model(Some(m))?,
            &args.forks,
        )?),
        None => None,
    };
    if args.json {
        let mut j = r.json();
        if let Some(source) = source {
            j["kv_config_source"] = serde_json::Value::String(source);
        }
        println!("{j}");
    } else {
        print!("{}", r.text());
        if let Some(source) = source {
            println!("per-layer KV settings: {source}");
        }
    }
    Ok(())
}

/// Resolves the fork flags and opens the model with them, printing every documented warning
/// (flags without effect, forks with nothing to act on in this model) to stderr.
pub fn open_session(
    dir: &std::path::Path,
    forks: &ForkArgs,
) -> anyhow::Result<(crate::engine::session::Session, Forks)> {
    let kv_config = forks.kv_config.clone();
    let forks = forks.forks()?;
    let mut session =
        crate::engine::session::Session::open_traced(dir, forks, super::progress::startup_trace())?;
    if let Some(path) = &kv_config {
        session.model.use_kv_config(path)?;
    }
    for w in &session.model.plan.warnings {
        eprintln!("mlxb: warning: {w}");
    }
    Ok((session, forks))
}
