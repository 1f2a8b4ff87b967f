//! `keel server --config FILE`: every server setting from a TOML file,
//! and `--print-config`, the effective configuration.
//!
//! A key is a server flag's long name, `-` or `_` between words
//! (`--round-s` is `round_s`); the TLS and trace flags the server shares
//! with the clients are keys too, the client-only ones are not. Every
//! setting also comes from the environment as `KEEL_` and its key in
//! capitals (`KEEL_ROUND_S`), or the variable the flag's help names.
//! Precedence: the command line, then the environment, then the file,
//! then the defaults.
//!
//! The file is turned into flags and parsed by the same clap definition
//! as the command line, so a key takes exactly what its flag takes and is
//! checked by the same parser; each key is checked alone first, so a bad
//! value is refused naming the key and the file, as is a key no flag has.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context};
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command};

/// The heading of the options `keel server` does not read (they are no
/// keys).
const CLIENT_ONLY: &str = crate::CLIENT_OPTIONS;

/// The subcommand whose settings a file holds.
const SERVER: &str = "server";

/// The arguments of the server that are not settings.
const NOT_SETTINGS: [&str; 4] = ["help", "version", "config", "print_config"];

/// What to do with the command line after the file was read.
#[derive(Debug)]
pub(crate) enum Prepared {
    /// Parse and run these arguments (the command line, with the
    /// environment's and the file's settings added as flags).
    Run(Vec<OsString>),
    /// `--print-config`: print this and stop.
    Print(String),
}

/// Where a setting's value came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    CommandLine,
    Environment,
    File,
    Default,
}

impl Source {
    fn describe(self) -> &'static str {
        match self {
            Source::CommandLine => "command line",
            Source::Environment => "environment",
            Source::File => "config file",
            Source::Default => "default",
        }
    }
}

/// One server setting: its key, and the flag it stands for.
struct Setting {
    key: String,
    arg: Arg,
}

impl Setting {
    fn id(&self) -> &str {
        self.arg.get_id().as_str()
    }

    fn flag(&self) -> String {
        format!("--{}", self.arg.get_long().unwrap_or(self.id()))
    }

    fn is_switch(&self) -> bool {
        matches!(self.arg.get_action(), ArgAction::SetTrue)
    }

    fn takes_many(&self) -> bool {
        matches!(self.arg.get_action(), ArgAction::Append)
    }

    /// The environment variable of this setting: the flag's own, or
    /// `KEEL_` and the key in capitals.
    fn env_var(&self) -> String {
        match self.arg.get_env() {
            Some(own) => own.to_string_lossy().into_owned(),
            None => format!("KEEL_{}", self.key.to_ascii_uppercase()),
        }
    }
}

/// The server's settings, in the order of its `--help`.
fn settings(command: &Command) -> Vec<Setting> {
    let mut command = command.clone();
    command.build();
    let Some(server) = command.find_subcommand(SERVER) else {
        return Vec::new();
    };
    server
        .get_arguments()
        .filter(|a| !a.is_positional())
        .filter(|a| a.get_help_heading() != Some(CLIENT_ONLY))
        .filter(|a| !NOT_SETTINGS.contains(&a.get_id().as_str()))
        .filter_map(|a| {
            let long = a.get_long()?;
            Some(Setting {
                key: long.replace('-', "_"),
                arg: a.clone(),
            })
        })
        .collect()
}

/// Reads `--config` and the environment into the command line `argv` of
/// `command` (anything other than `keel server` is returned as it is, as
/// is a command line clap refuses: its own parse says why). `env` reads
/// an environment variable.
pub(crate) fn prepare(
    command: &Command,
    argv: Vec<OsString>,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<Prepared> {
    let Ok(matches) = command.clone().try_get_matches_from(&argv) else {
        return Ok(Prepared::Run(argv));
    };
    let Some((SERVER, given)) = matches.subcommand() else {
        return Ok(Prepared::Run(argv));
    };
    let settings = settings(command);
    let mut sources: BTreeMap<String, Source> = BTreeMap::new();
    let mut added: Vec<OsString> = Vec::new();
    for s in &settings {
        match given.value_source(s.id()) {
            Some(ValueSource::CommandLine) => {
                sources.insert(s.key.clone(), Source::CommandLine);
            }
            Some(ValueSource::EnvVariable) => {
                sources.insert(s.key.clone(), Source::Environment);
            }
            _ if s.arg.get_env().is_none() => {
                let var = s.env_var();
                if let Some(value) = env(&var) {
                    let flags = flags_of_text(s, &value);
                    check_alone(command, &flags)
                        .map_err(|e| anyhow!("environment variable {var}={value:?}: {e}"))?;
                    added.extend(flags);
                    sources.insert(s.key.clone(), Source::Environment);
                }
            }
            _ => {}
        }
    }
    if let Some(path) = given.get_one::<PathBuf>("config") {
        let table = read_table(path)?;
        let by_key: BTreeMap<&str, &Setting> =
            settings.iter().map(|s| (s.key.as_str(), s)).collect();
        for (key, value) in &table {
            let Some(s) = by_key.get(key.replace('-', "_").as_str()) else {
                bail!(
                    "{}: unknown key `{key}` (a key is a `keel server` flag's name, \
                     `--round-s` as `round_s`; `keel server --print-config` lists them)",
                    path.display()
                );
            };
            let flags = flags_of_value(s, value)
                .and_then(|flags| check_alone(command, &flags).map(|()| flags))
                .map_err(|e| anyhow!("{}: key `{key}`: {e}", path.display()))?;
            if sources.contains_key(&s.key) {
                // The command line or the environment says otherwise.
                continue;
            }
            added.extend(flags);
            sources.insert(s.key.clone(), Source::File);
        }
    }
    let mut argv = argv;
    argv.extend(added);
    let matches = command.clone().try_get_matches_from(&argv).map_err(|e| {
        anyhow!(
            "with the settings of the environment and --config: {}",
            first_line(&e)
        )
    })?;
    let Some((SERVER, effective)) = matches.subcommand() else {
        return Ok(Prepared::Run(argv));
    };
    if effective.get_flag("print_config") {
        return Ok(Prepared::Print(print(&settings, effective, &sources)));
    }
    Ok(Prepared::Run(argv))
}

fn read_table(path: &Path) -> anyhow::Result<toml::Table> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the config file {}", path.display()))?;
    text.parse::<toml::Table>().map_err(|e| {
        anyhow!(
            "{} is not TOML: {}",
            path.display(),
            e.to_string().trim_end()
        )
    })
}

/// The flags that give setting `s` the text `value` (from the
/// environment: a list is comma-separated, as on the command line).
fn flags_of_text(s: &Setting, value: &str) -> Vec<OsString> {
    if s.is_switch() {
        let on = matches!(
            value.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on" | "y"
        );
        return if on {
            vec![s.flag().into()]
        } else {
            Vec::new()
        };
    }
    vec![format!("{}={value}", s.flag()).into()]
}

/// The flags that give setting `s` the TOML `value`.
fn flags_of_value(s: &Setting, value: &toml::Value) -> anyhow::Result<Vec<OsString>> {
    if s.is_switch() {
        let toml::Value::Boolean(on) = value else {
            bail!("takes true or false, not {}", value.type_str());
        };
        return Ok(if *on {
            vec![s.flag().into()]
        } else {
            Vec::new()
        });
    }
    let values: Vec<&toml::Value> = match value {
        toml::Value::Array(items) if s.takes_many() => items.iter().collect(),
        toml::Value::Array(_) => bail!("takes one value, not a list"),
        one => vec![one],
    };
    values
        .into_iter()
        .map(|v| {
            let text = match v {
                toml::Value::String(t) => t.clone(),
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Float(f) => f.to_string(),
                other => bail!("takes a string or a number, not {}", other.type_str()),
            };
            Ok(format!("{}={text}", s.flag()).into())
        })
        .collect()
}

/// Whether `keel server` with only `flags` is a command line clap takes
/// (its error, shortened, when not).
fn check_alone(command: &Command, flags: &[OsString]) -> anyhow::Result<()> {
    let mut argv: Vec<OsString> = vec!["keel".into(), SERVER.into()];
    argv.extend(flags.iter().cloned());
    match command.clone().try_get_matches_from(argv) {
        Ok(_) => Ok(()),
        // A setting that needs another (`k8s_namespace` needs
        // `kubernetes`): the whole command line is checked after.
        Err(e) if e.kind() == clap::error::ErrorKind::MissingRequiredArgument => Ok(()),
        Err(e) => Err(anyhow!("{}", first_line(&e))),
    }
}

/// A clap error's first paragraph on one line, without its `error: `
/// (and without the usage and help lines after it).
fn first_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let paragraph = text.split("\n\n").next().unwrap_or_default();
    let joined = paragraph
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    joined
        .strip_prefix("error: ")
        .unwrap_or(&joined)
        .to_string()
}

/// The effective configuration as a config file, each setting with where
/// its value came from.
fn print(
    settings: &[Setting],
    effective: &ArgMatches,
    sources: &BTreeMap<String, Source>,
) -> String {
    let mut out = String::from(
        "# keel server: the effective configuration (the command line, then KEEL_* \
         variables, then --config, then the defaults, shown as comments).\n",
    );
    for s in settings {
        let source = sources.get(&s.key).copied().unwrap_or(Source::Default);
        let line = if s.is_switch() {
            Some(format!("{} = {}", s.key, effective.get_flag(s.id())))
        } else {
            effective.get_raw(s.id()).map(|raw| {
                let texts: Vec<String> = raw.map(|v| v.to_string_lossy().into_owned()).collect();
                let value = if s.takes_many() {
                    let items: Vec<String> = texts.iter().map(|t| toml_value(t)).collect();
                    format!("[{}]", items.join(", "))
                } else {
                    texts.first().map(|t| toml_value(t)).unwrap_or_default()
                };
                format!("{} = {value}", s.key)
            })
        };
        // A default is shown as a comment: read back, the file sets
        // only what differs from the defaults.
        let comment = if source == Source::Default { "# " } else { "" };
        match line {
            Some(line) => out.push_str(&format!("{comment}{line}  # {}\n", source.describe())),
            None => out.push_str(&format!("# {} = (not set)\n", s.key)),
        }
    }
    out
}

/// `text` as a TOML value: a number where it reads back as the same
/// text, a string otherwise.
fn toml_value(text: &str) -> String {
    if text.parse::<i64>().is_ok_and(|i| i.to_string() == text) {
        return text.to_string();
    }
    if text.contains('.')
        && text
            .parse::<f64>()
            .is_ok_and(|f| f.is_finite() && f.to_string() == text)
    {
        return text.to_string();
    }
    toml::Value::String(text.to_string()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn command() -> Command {
        crate::Args::command()
    }

    fn argv(words: &[&str]) -> Vec<OsString> {
        words.iter().map(OsString::from).collect()
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn file(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = dir.path().join("keel.toml");
        std::fs::write(&path, text).expect("write");
        (dir, path)
    }

    fn printed(words: &[&str], env: &dyn Fn(&str) -> Option<String>) -> String {
        match prepare(&command(), argv(words), env).expect("prepare") {
            Prepared::Print(text) => text,
            Prepared::Run(argv) => panic!("not printed: {argv:?}"),
        }
    }

    /// What `keel server --config FILE --print-config` prints.
    fn printed_with(file: &Path) -> String {
        let file = file.to_str().expect("utf-8");
        printed(
            &["keel", "server", "--config", file, "--print-config"],
            &no_env,
        )
    }

    /// The value line of `key` in a printed configuration.
    fn line_of<'a>(printed: &'a str, key: &str) -> &'a str {
        printed
            .lines()
            .find(|l| l.starts_with(&format!("{key} = ")) || l.starts_with(&format!("# {key} = ")))
            .unwrap_or_else(|| panic!("{key} not printed:\n{printed}"))
    }

    #[test]
    fn every_server_flag_has_a_key_and_no_client_flag_has_one() {
        let keys: Vec<String> = settings(&command()).into_iter().map(|s| s.key).collect();
        let text = printed(&["keel", "server", "--print-config"], &no_env);
        let mut cmd = command();
        cmd.build();
        let server = cmd.find_subcommand(SERVER).expect("server");
        let mut flags = 0;
        for arg in server.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            let key = long.replace('-', "_");
            let client_only = arg.get_help_heading() == Some(CLIENT_ONLY);
            let not_setting = NOT_SETTINGS.contains(&arg.get_id().as_str());
            assert_eq!(keys.contains(&key), !client_only && !not_setting, "{long}");
            if !client_only && !not_setting {
                line_of(&text, &key);
                flags += 1;
            }
        }
        assert!(flags > 40, "only {flags} settings");
        for client in ["addr", "token", "output", "stale"] {
            assert!(!keys.contains(&client.to_string()), "{client}");
        }
        for shared in ["tls_cert", "tls_key", "tls_ca", "otlp_endpoint"] {
            assert!(keys.contains(&shared.to_string()), "{shared}");
        }
    }

    #[test]
    fn a_printed_configuration_read_back_prints_the_same() {
        let (_dir, first) = file(
            "data_dir = \"/var/lib/keel\"\nround_s = 2.5\nid = 2\n\
             peers = [\"1=keel-0:7070\", \"2=keel-1:7070\", \"3=keel-2:7070\"]\n\
             backfill = true\npolicy = \"tiresias\"\ntiresias_thresholds_gpu_s = [600, 3600]\n\
             gpu_prices = [\"v100=2.48\", \"k80=0.7\"]\nhttp-listen = \"off\"\n\
             trace_sample_ratio = 0.25\nsimulated_gpus = \"4xv100\"\n",
        );
        let once = printed_with(&first);
        for (key, starts) in [
            ("round_s", "round_s = 2.5  # config file"),
            (
                "peers",
                "peers = [\"1=keel-0:7070\", \"2=keel-1:7070\", \"3=keel-2:7070\"]",
            ),
            ("backfill", "backfill = true"),
            ("http_listen", "http_listen = \"off\""),
            ("snapshot_every", "# snapshot_every = 10000  # default"),
        ] {
            assert!(line_of(&once, key).starts_with(starts), "{key}: {once}");
        }
        assert_eq!(line_of(&once, "executor_dir"), "# executor_dir = (not set)");
        // Read back: the same values, now all from the file.
        let (_dir2, second) = file(&once);
        let twice = printed_with(&second);
        let values = |t: &str| -> Vec<String> {
            t.lines()
                .filter(|l| !l.starts_with('#'))
                .map(|l| l.split("  # ").next().unwrap_or_default().to_string())
                .collect()
        };
        assert_eq!(values(&once), values(&twice));
        assert!(twice
            .lines()
            .filter(|l| !l.starts_with('#'))
            .all(|l| l.ends_with("# config file")));
    }

    #[test]
    fn the_command_line_beats_the_environment_which_beats_the_file() {
        let (_dir, path) = file("round_s = 3.0\npolicy = \"srjf\"\nsnapshot_every = 500\n");
        let path = path.to_str().expect("utf-8");
        let env = |var: &str| match var {
            "KEEL_POLICY" => Some("tiresias".to_string()),
            "KEEL_SNAPSHOT_EVERY" => Some("700".to_string()),
            _ => None,
        };
        let text = printed(
            &[
                "keel",
                "server",
                "--config",
                path,
                "--snapshot-every",
                "900",
                "--print-config",
            ],
            &env,
        );
        assert_eq!(line_of(&text, "round_s"), "round_s = 3  # config file");
        assert_eq!(
            line_of(&text, "policy"),
            "policy = \"tiresias\"  # environment"
        );
        assert_eq!(
            line_of(&text, "snapshot_every"),
            "snapshot_every = 900  # command line"
        );
        // Running (not printing): the file's and the environment's flags are
        // on the command line clap parses.
        let Prepared::Run(run) = prepare(
            &command(),
            argv(&[
                "keel",
                "server",
                "--config",
                path,
                "--snapshot-every",
                "900",
            ]),
            &env,
        )
        .expect("prepare") else {
            panic!("printed");
        };
        let run: Vec<String> = run
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert!(run.contains(&"--round-s=3".to_string()), "{run:?}");
        assert!(run.contains(&"--policy=tiresias".to_string()), "{run:?}");
        assert!(
            !run.iter().any(|a| a.starts_with("--snapshot-every=")),
            "{run:?}"
        );
    }

    #[test]
    fn an_unknown_key_or_a_bad_value_is_refused_naming_the_key() {
        let refused = |text: &str| -> String {
            let (_dir, path) = file(text);
            let words = ["keel", "server", "--config", path.to_str().expect("utf-8")];
            match prepare(&command(), argv(&words), &no_env) {
                Ok(p) => panic!("{text:?} taken: {p:?}"),
                Err(e) => format!("{e:#}"),
            }
        };
        for (text, words) in [
            (
                "round_seconds = 3\n",
                &["unknown key `round_seconds`", "keel.toml"][..],
            ),
            ("addr = \"127.0.0.1:7070\"\n", &["unknown key `addr`"]),
            ("round_s = \"soon\"\n", &["key `round_s`", "soon"]),
            ("max_event_streams = 0\n", &["key `max_event_streams`", "0"]),
            (
                "backfill = \"yes\"\n",
                &["key `backfill`: takes true or false"],
            ),
            (
                "policy = [\"fifo\", \"srjf\"]\n",
                &["key `policy`: takes one value"],
            ),
            ("peers = [\"one\"]\n", &["key `peers`", "ID=HOST:PORT"]),
            ("[server]\nround_s = 3\n", &["unknown key `server`"]),
            ("k8s_namespace = \"training\"\n", &["--kubernetes"]),
            ("round_s = \n", &["is not TOML"]),
        ] {
            let e = refused(text);
            for w in words {
                assert!(e.contains(w), "{text:?}: {w:?} not in {e}");
            }
        }
        // A bad value from the environment names the variable.
        let env = |var: &str| (var == "KEEL_ROUND_S").then(|| "soon".to_string());
        let e = prepare(&command(), argv(&["keel", "server"]), &env).expect_err("refused");
        assert!(format!("{e:#}").contains("KEEL_ROUND_S"), "{e:#}");
    }

    #[test]
    fn other_commands_and_refused_command_lines_pass_through() {
        for words in [
            &["keel", "jobs"][..],
            &["keel", "server", "--no-such-flag"][..],
            &["keel", "server", "--data-dir", "d"][..],
        ] {
            match prepare(&command(), argv(words), &no_env).expect("prepare") {
                Prepared::Run(out) => assert_eq!(out, argv(words)),
                Prepared::Print(p) => panic!("{p}"),
            }
        }
    }
}
