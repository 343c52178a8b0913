//! Writing an output directory all-or-nothing.
//!
//! Files go into a hidden sibling folder; [`AtomicDir::commit`] renames it over the target.
//! Dropping an uncommitted `AtomicDir` (an error, a panic) removes the temporary folder, so a
//! failed run leaves neither a half-written output nor debris. A killed process can leave the
//! hidden sibling behind, never a half-written target.

use std::io;
use std::path::{Path, PathBuf};

pub struct AtomicDir {
    tmp: PathBuf,
    target: PathBuf,
    committed: bool,
}

impl AtomicDir {
    pub fn new(target: &Path) -> io::Result<Self> {
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent)?;
        let name = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "output".into());
        let tmp = parent.join(format!(".{name}.partial-{}", std::process::id()));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp)?;
        }
        std::fs::create_dir(&tmp)?;
        Ok(AtomicDir {
            tmp,
            target: target.to_path_buf(),
            committed: false,
        })
    }

    /// Where to write the files before commit.
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    /// Replaces the target with the finished folder.
    pub fn commit(mut self) -> io::Result<()> {
        if self.target.exists() {
            let old = self.tmp.with_extension("old");
            std::fs::rename(&self.target, &old)?;
            std::fs::rename(&self.tmp, &self.target)?;
            std::fs::remove_dir_all(&old)?;
        } else {
            std::fs::rename(&self.tmp, &self.target)?;
        }
        self.committed = true;
        Ok(())
    }
}

impl Drop for AtomicDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uncommitted_output_leaves_nothing() {
        let base = std::env::temp_dir().join(format!("kestrel-atomic-{}", std::process::id()));
        let target = base.join("out");
        {
            let dir = AtomicDir::new(&target).unwrap();
            std::fs::write(dir.path().join("f"), b"x").unwrap();
        }
        assert!(!target.exists());
        assert_eq!(std::fs::read_dir(&base).unwrap().count(), 0);
        let dir = AtomicDir::new(&target).unwrap();
        std::fs::write(dir.path().join("f"), b"y").unwrap();
        dir.commit().unwrap();
        assert_eq!(std::fs::read(target.join("f")).unwrap(), b"y");
        std::fs::remove_dir_all(&base).unwrap();
    }
}
