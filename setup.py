from configparser import ConfigParser
from pathlib import Path
import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read('settings.ini', encoding='utf-8')
cfg = cfg['DEFAULT']

licenses = {'apache2': ('Apache Software License 2.0', 'OSI Approved :: Apache Software License')}
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable', '6 - Mature', '7 - Inactive']
py_versions = '3.10 3.11 3.12 3.13 3.14'.split()
min_python = cfg['min_python']
if min_python not in py_versions: raise ValueError(f"settings.ini: min_python={min_python} is not one of {py_versions}")
lic = licenses[cfg['license']]

setuptools.setup(
    name=cfg['lib_name'],
    version=cfg['version'],
    description=cfg['description'],
    long_description=Path('README.md').read_text(encoding='utf-8'),
    long_description_content_type='text/markdown',
    author=cfg['author'],
    author_email=cfg['author_email'],
    license=lic[0],
    url=cfg['git_url'],
    keywords=cfg['keywords'].split(),
    classifiers=['Development Status :: ' + statuses[int(cfg['status'])],
                 'Intended Audience :: ' + cfg['audience'].title(),
                 'License :: ' + lic[1],
                 'Natural Language :: ' + cfg['language'].title()]
                + ['Programming Language :: Python :: ' + v for v in py_versions[py_versions.index(min_python):]],
    packages=setuptools.find_packages(include=['dflash', 'dflash.*']),
    include_package_data=True,
    package_data={'dflash': ['assets/**/*']},
    python_requires='>=' + min_python,
    install_requires=cfg['requirements'].split(),
    extras_require={'dev': cfg['dev_requirements'].split(), 'gguf': cfg['gguf_requirements'].split()},
    entry_points={'console_scripts': cfg.get('console_scripts', '').split()},
    zip_safe=False,
)
